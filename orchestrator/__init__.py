"""The serving side of DSpark: the in-flight batching engine and the Triton BLS model around it.

engine.py  continuous batching over the reference loop's round functions (no server needed)
"""
