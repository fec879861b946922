"""Fakes of the outside engines (vLLM, DeepSpeed) that several test files share; real torch underneath."""
