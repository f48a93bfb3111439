"""Loading models (local directories, GGUF, Hub ids, random weights from a config or shape), the demo model and
the calibration store."""
