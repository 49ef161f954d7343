"""`make engines`: ONNX graphs → engines (ONNX Runtime on CPU, TensorRT plans where possible),
plus the runtime that runs them behind the same interfaces as the PyTorch reference."""
