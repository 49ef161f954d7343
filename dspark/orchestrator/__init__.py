"""The `dspark` BLS model: in-flight batching over the round API, scheduling, streaming."""
