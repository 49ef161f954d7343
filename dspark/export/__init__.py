"""torch → ONNX: one graph per role (target step, drafter context, drafter backbone, drafter head).

Every graph has explicit input/output names (see each module's NAMES) and is exported with the
legacy TorchScript exporter at OPSET: it exports SmolLM2 in seconds where the dynamo exporter
takes minutes, and ONNX Runtime matches PyTorch to ~1e-5 on both (shared/reference/cpu-runtime.md §4).
"""

OPSET = 17


def export_graph(module, example, path, input_names, output_names, dynamic_axes):
    """torch.onnx.export with our settings (legacy exporter, OPSET, no grad); returns the path."""
    from pathlib import Path

    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(
            module,
            example,
            str(path),
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
            opset_version=OPSET,
            dynamo=False,
        )
    return path
