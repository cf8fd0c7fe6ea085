"""Commands run as users run them: torchrun and the examples, the emulated cluster, calibration, wheels."""
