"""dspark-triton: lossless DSpark speculative decoding, compiled and served in NVIDIA Triton.

The package is the pipeline, each subpackage importing only those before it:

  core/              the algorithm: interfaces, sampling, verification, SPS(B), scheduler,
                     calibration, metrics, the round API and the reference loop (the oracle)
  models/            PyTorch models: the target, the drafters (DSpark/DFlash, EAGLE-3), their
                     losses, the slot-based runners
  training/          the target answers the prompts, drafters train on the cache, evaluation
  export/            torch → ONNX graphs
  engines/           `make engines`: ONNX → engines (ONNX Runtime; TensorRT where present)
  model_repository/  the Triton model repository: templates, rendering, the models' services
  orchestrator/      the `dspark` BLS model: in-flight batching, scheduling, streaming
  serving/           run tritonserver and talk to it (launcher, client)
  perf/              SPS(B) with perf_analyzer, the serving benchmark
  cli/               the `dspark` command on top of it all
"""
