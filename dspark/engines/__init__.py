"""`make engines`: ONNX graphs → engines (ONNX Runtime, TensorRT plans with PROFILE=gpu), plus the
runtimes (torch | ort | tensorrt on cpu | cuda:N) and runners that run them behind the same
interfaces as the PyTorch reference."""
