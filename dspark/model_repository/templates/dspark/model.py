"""Triton python model `dspark`: the decoupled BLS orchestrator (streaming).

execute() hands each request to orchestrator/serving.py's engine thread and returns None;
the thread batches every active sequence each round (in-flight batching), calls the target and
drafter models through BLS, and streams committed tokens back through the request's sender.
"""

import json
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


class _Sender:
    def __init__(self, sender):
        self.sender = sender

    def send(self, outputs, final):
        tensors = [pb_utils.Tensor(k, v) for k, v in outputs.items()]
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)

    def error(self, message):
        err = pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)
        self.sender.send(
            pb_utils.InferenceResponse(error=err), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )

    def is_cancelled(self):
        return self.sender.is_cancelled()


_CPU_OUTPUTS = {}  # set in initialize when the engine models may answer with GPU tensors


def _numpy(t):
    if t.is_cpu():
        return t.as_numpy()
    from torch.utils.dlpack import from_dlpack  # a GPU tensor Triton did not move: copy it here

    return from_dlpack(t.to_dlpack()).cpu().numpy()


def _bls(model, inputs, outputs):
    tensors = [pb_utils.Tensor(k, np.ascontiguousarray(v)) for k, v in inputs.items()]
    request = pb_utils.InferenceRequest(
        model_name=model, requested_output_names=list(outputs), inputs=tensors, **_CPU_OUTPUTS
    )
    response = request.exec()
    if response.has_error():
        raise RuntimeError(f"{model}: {response.error().message()}")
    return {k: _numpy(pb_utils.get_output_tensor_by_name(response, k)) for k in outputs}


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        sys.path.insert(0, params["code_root"])
        import torch

        from dspark.orchestrator.metrics import TritonMetricsBackend
        from dspark.orchestrator.runtime import make_orchestrator

        # the orchestrator's tensors are small (sampling, verification): one thread, so that no
        # idle OpenMP pool spins on the cores the target model's process needs during a BLS call
        torch.set_num_threads(1)
        self.inputs = [i["name"] for i in config["input"]]
        if params.get("outputs") == "device":  # the target answers on the GPU: Triton copies to host once
            _CPU_OUTPUTS["preferred_memory"] = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)
        self.metrics = TritonMetricsBackend(pb_utils)
        self.orchestrator = make_orchestrator(params, _bls, self.metrics).start()

    def execute(self, requests):
        for request in requests:
            inputs = {}
            for name in self.inputs:
                t = pb_utils.get_input_tensor_by_name(request, name)
                if t is not None:
                    inputs[name] = t.as_numpy()
            self.orchestrator.submit(inputs, _Sender(request.get_response_sender()))
        return None

    def finalize(self):
        self.orchestrator.stop()
        self.metrics.close()  # while the stub can still reach tritonserver (see TritonMetricsBackend)
