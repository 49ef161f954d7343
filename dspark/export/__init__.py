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
        out = module(*example)
    pin_output_dims(path, dict(zip(output_names, out)), dynamic_axes)
    return path


def pin_output_dims(path, example_outputs: dict, dynamic_axes: dict) -> None:
    """Give every output dim that is not a declared dynamic axis its fixed size (the tracer
    names some static dims, e.g. `Addnew_key.0_dim_3` for head_dim). Runtimes then know every
    output's shape from the input shapes alone and can preallocate it on the device (IOBinding,
    TensorRT); the build's gates check the declared shapes against real outputs."""
    import onnx

    model = onnx.load(str(path))
    changed = False
    for o in model.graph.output:
        axes = (dynamic_axes or {}).get(o.name, {})
        for k, d in enumerate(o.type.tensor_type.shape.dim):
            if d.HasField("dim_param") and k not in axes:
                d.Clear()
                d.dim_value = int(example_outputs[o.name].shape[k])
                changed = True
    if changed:
        onnx.save(model, str(path))
