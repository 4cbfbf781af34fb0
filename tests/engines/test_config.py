import pytest

from engines.config import GiB, EngineBuildConfig, format_size, parse_size
from engines.errors import EngineConfigError
from runtime.artifact.manifest import load_manifest


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * GiB), ("512MiB", 512 * 1024**2), ("1.5GiB", 3 * GiB // 2), ("64KiB", 65536),
    ("2GB", 2_000_000_000), ("2gib", 2 * GiB), (" 1 GiB ", GiB), ("1048576", 1048576), (4096, 4096),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["2GX", "GiB", "-1GiB", "", "1.5.2GiB", True])
def test_parse_size_rejects(text):
    with pytest.raises(EngineConfigError, match="is not a size: pass bytes or a number with KiB, MiB or GiB"):
        parse_size(text)


def test_parse_size_rejects_zero():
    with pytest.raises(EngineConfigError, match="must be at least 1 byte"):
        parse_size("0MiB")


def test_format_size():
    assert [format_size(n) for n in (2 * GiB, 512 * 1024**2, 1536, 10)] == ["2GiB", "512MiB", "1.5KiB", "10B"]


def test_defaults_and_prompt_limit():
    config = EngineBuildConfig()
    assert (config.max_batch, config.max_seq, config.workspace, config.precision) == (8, 1024, 2 * GiB, "fp32")
    assert config.prompt_limit == 1024
    assert EngineBuildConfig(max_prompt=128).prompt_limit == 128


@pytest.fixture
def model(artifact_dir):
    return load_manifest(artifact_dir, check_hashes=False).model  # max_position_embeddings 64


def test_validate_accepts_the_model_limits(model):
    EngineBuildConfig(max_batch=1, max_seq=64, max_prompt=64).validate(model)


def test_max_seq_over_positions(model):
    with pytest.raises(EngineConfigError) as info:
        EngineBuildConfig(max_seq=65).validate(model)
    assert str(info.value) == ("max_seq 65 exceeds max_position_embeddings 64 of this model: positions "
                               "past 64 have no embedding; pass --max-seq 64 or less")


def test_max_prompt_over_max_seq(model):
    with pytest.raises(EngineConfigError) as info:
        EngineBuildConfig(max_seq=32, max_prompt=40).validate(model)
    assert str(info.value) == ("max_prompt 40 exceeds max_seq 32: a prompt must fit in the sequence; "
                               "pass --max-prompt 32 or less, or raise --max-seq")


@pytest.mark.parametrize("field, value, flag", [("max_batch", 0, "--max-batch"), ("max_seq", -1, "--max-seq"),
                                                ("workspace", 0, "--workspace"), ("max_batch", 2.0, "--max-batch")])
def test_positive_ints(model, field, value, flag):
    with pytest.raises(EngineConfigError, match=f"{field} must be a positive int, got {value!r}; pass {flag}"):
        EngineBuildConfig(**{field: value}).validate(model)


def test_precision(model):
    with pytest.raises(EngineConfigError, match="precision must be fp32 or fp16, got 'int8'"):
        EngineBuildConfig(max_seq=64, precision="int8").validate(model)
