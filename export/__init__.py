"""torch → ONNX: one graph per role (target step, drafter context, drafter backbone, drafter head).

Every graph has explicit input/output names (see each module's NAMES) and is exported with the
legacy TorchScript exporter at OPSET: it exports SmolLM2 in seconds where the dynamo exporter
takes minutes, and ONNX Runtime matches PyTorch to ~1e-5 on both (shared/reference/cpu-runtime.md §4).
"""

OPSET = 17
