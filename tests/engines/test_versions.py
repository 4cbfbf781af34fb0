"""Version-dependent choices, decided from version strings (TensorRT itself is not installed)."""

from types import SimpleNamespace

import pytest

from engines.builder import network_flags, pin_fp32_layers
from engines.errors import EngineConfigError, TensorRTVersionError
from engines.versions import NetworkPlan, check_supported, keep_fp32, network_plan, parse_version


@pytest.mark.parametrize("text, expected", [("8.6.2.3", (8, 6, 2, 3)), ("10.3.0", (10, 3, 0)),
                                            ("10.3.0.post1", (10, 3, 0)), ("11", (11,))])
def test_parse_version(text, expected):
    assert parse_version(text) == expected


def test_parse_version_garbage():
    with pytest.raises(TensorRTVersionError, match="cannot read a TensorRT version from 'dev'"):
        parse_version("dev")


@pytest.mark.parametrize("version", ["8.5.1.7", "8.5.2.2", "8.6.2.3", "10.3.0", "10.13.0"])
def test_supported(version):
    check_supported(version)


@pytest.mark.parametrize("version", ["8.2.1", "8.4.3.1", "8.5.0.9", "7.1.3"])
def test_too_old(version):
    with pytest.raises(TensorRTVersionError) as info:
        check_supported(version)
    assert str(info.value).startswith(f"TensorRT {version} is too old: this toolkit needs TensorRT 8.5.1 or newer")


def plan(precision, explicit_batch=False, strongly_typed=False, fp16_flag=False, fp32_layers=False):
    return NetworkPlan(precision, explicit_batch, strongly_typed, fp16_flag, fp32_layers)


@pytest.mark.parametrize("version, dtype, precision, expected", [
    # JetPack 5 (8.5.2) and JetPack 6.0 (8.6.2): explicit batch, weak typing with FP16 + fp32 islands
    ("8.5.2.2", "float32", "fp32", plan("fp32", explicit_batch=True)),
    ("8.5.2.2", "float16", "fp32", plan("fp16", True, fp16_flag=True, fp32_layers=True)),
    ("8.6.2.3", "float32", "fp16", plan("fp16", True, fp16_flag=True, fp32_layers=True)),
    ("8.6.2.3", "float16", "fp16", plan("fp16", True, fp16_flag=True, fp32_layers=True)),
    # JetPack 6.1/6.2 (10.3): fp16 ONNX -> strongly typed; fp32 ONNX + --fp16 -> weak typing, no batch flag
    ("10.3.0", "float16", "fp32", plan("fp16", strongly_typed=True)),
    ("10.3.0", "float16", "fp16", plan("fp16", strongly_typed=True)),
    ("10.3.0", "float32", "fp16", plan("fp16", fp16_flag=True, fp32_layers=True)),
    ("10.3.0", "float32", "fp32", plan("fp32")),
    # 11.x: strongly typed only
    ("11.4.0", "float16", "fp32", plan("fp16", strongly_typed=True)),
    ("11.4.0", "float32", "fp32", plan("fp32", strongly_typed=True)),
])
def test_network_plan(version, dtype, precision, expected):
    assert network_plan(version, dtype, precision) == expected


def test_fp16_from_fp32_onnx_on_strongly_typed_only_tensorrt():
    with pytest.raises(EngineConfigError) as info:
        network_plan("11.4.0", "float32", "fp16")
    assert str(info.value) == (
        "TensorRT 11.4.0 builds strongly typed networks only, so an fp32 ONNX export gives an fp32 "
        "engine; for fp16 re-export with `python -m export build --dtype fp16` and build again, or drop --fp16")


@pytest.mark.parametrize("layer_type, name, expected", [
    ("NORMALIZATION", "/self_attn_layer_norm/LayerNormalization", True),
    ("SOFTMAX", "/Softmax", True),
    ("REDUCE", "/final_layer_norm/ReduceMean", True),
    ("ELEMENTWISE", "/self_attn_layer_norm/Sub", True),
    ("ELEMENTWISE", "/self_attn/Add", False),
    ("MATRIX_MULTIPLY", "/fc1/MatMul", False),
    ("CONSTANT", "self_attn_layer_norm.weight", False),
])
def test_keep_fp32(layer_type, name, expected):
    assert keep_fp32(layer_type, name) is expected


# -- the flag arithmetic and layer pinning, on a minimal stand-in for the tensorrt module ------

FLOAT32, FLOAT16, INT32 = "float32", "float16", "int32"


def fake_trt(with_strongly_typed: bool):
    flags = SimpleNamespace(EXPLICIT_BATCH=0)
    if with_strongly_typed:
        flags.STRONGLY_TYPED = 1
    return SimpleNamespace(NetworkDefinitionCreationFlag=flags, float32=FLOAT32, float16=FLOAT16)


def test_network_flags():
    assert network_flags(fake_trt(False), network_plan("8.6.2.3", "float16")) == 0b01
    assert network_flags(fake_trt(True), network_plan("10.3.0", "float16")) == 0b10
    assert network_flags(fake_trt(True), network_plan("10.3.0", "float32", "fp16")) == 0
    assert network_flags(fake_trt(True), network_plan("10.3.0", "float32")) == 0


class Layer:
    def __init__(self, type_name, name, outputs):
        self.type, self.name = SimpleNamespace(name=type_name), name
        self._outputs = [SimpleNamespace(dtype=d) for d in outputs]
        self.precision, self.output_types = None, {}

    @property
    def num_outputs(self):
        return len(self._outputs)

    def get_output(self, j):
        return self._outputs[j]

    def set_output_type(self, j, dtype):
        self.output_types[j] = dtype


def test_pin_fp32_layers():
    layers = [Layer("NORMALIZATION", "/self_attn_layer_norm/LayerNormalization", [FLOAT16]),
              Layer("SOFTMAX", "/Softmax", [FLOAT16]),
              Layer("MATRIX_MULTIPLY", "/q_proj/MatMul", [FLOAT16]),
              Layer("REDUCE", "/final_layer_norm/ArgMax", [INT32])]
    network = SimpleNamespace(num_layers=len(layers), get_layer=lambda i: layers[i])
    pinned = pin_fp32_layers(fake_trt(False), network)
    assert pinned == ["/self_attn_layer_norm/LayerNormalization", "/Softmax", "/final_layer_norm/ArgMax"]
    assert [layer.precision for layer in layers] == [FLOAT32, FLOAT32, None, FLOAT32]
    assert layers[0].output_types == {0: FLOAT32} and layers[1].output_types == {0: FLOAT32}
    assert layers[3].output_types == {}  # an index output is never retyped
