"""Triton python model for one stateful/stateless service (target, drafter_backbone, drafter_head).

Rendered from model_repository/templates by `dspark serve` / dspark.model_repository.render; the logic
lives in orchestrator/services.py — this file only converts tensors and errors. The stub's
interpreter ignores PYTHONPATH, so the project root comes from the `code_root` parameter.
"""

import json
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


def _tensor(name, value):
    """numpy → a Triton tensor (a copy into shared memory); a torch tensor on the GPU → handed
    over through DLPack, no copy here (Triton moves it where the caller asked for it)."""
    if isinstance(value, np.ndarray):
        return pb_utils.Tensor(name, np.ascontiguousarray(value))
    return pb_utils.Tensor.from_dlpack(name, value)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        if args.get("model_instance_kind") in ("GPU", "KIND_GPU"):  # the instance's own GPU
            params["device_id"] = args.get("model_instance_device_id", "0")
        sys.path.insert(0, params["code_root"])
        from dspark.model_repository.services import make_service

        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]
        self.service = make_service(params)
        self.slots_metric = None
        if hasattr(self.service, "active"):  # stateful: publish the sequences it holds
            # one family per model: two stub processes must not register the same family name
            self.slots_family = pb_utils.MetricFamily(
                name=f"dspark_{args['model_name']}_sequences",
                description=f"Sequences whose cache the {args['model_name']} model holds",
                kind=pb_utils.MetricFamily.GAUGE,
            )
            self.slots_metric = self.slots_family.Metric(labels={})
            self.slots_metric.set(0)

    def execute(self, requests):
        from dspark.core.interfaces import RequestError

        responses = []
        for request in requests:
            try:
                inputs = {}
                for name in self.inputs:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    if t is not None:
                        inputs[name] = t.as_numpy()
                out = self.service.handle(inputs)
                wanted = set(request.requested_output_names()) or set(self.outputs)
                tensors = [_tensor(k, v) for k, v in out.items() if k in wanted]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except RequestError as e:
                err = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=err))
            except Exception as e:  # noqa: BLE001 - every failure becomes this request's error
                responses.append(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(e).__name__}: {e}"))
                )
        if self.slots_metric is not None:
            self.slots_metric.set(self.service.active)
        return responses

    def finalize(self):
        # drop the metric objects while the stub can still reach tritonserver: left to the
        # interpreter's exit, their destructors message a parent that is gone and the stub
        # segfaults (python backend 2.51: Metric::Clear after the shared memory is unmapped)
        self.slots_metric = self.slots_family = None
