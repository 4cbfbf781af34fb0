"""TensorRT engines from the per-layer ONNX graphs (one engine per graph, optimization profiles for
prefill and decode, shared timing cache). Not built yet: see the project's issue on TensorRT.

TensorRT is imported lazily by the modules that need it, so the CPU-only install imports this
package.
"""
