"""Kubernetes / KServe manifests for serving the rendered Triton repository (`dspark deploy`)."""
