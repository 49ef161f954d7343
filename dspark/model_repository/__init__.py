"""The Triton model repository: config templates, rendering for a profile, and the services the
python-backend models run (target, drafter_backbone, drafter_head)."""
