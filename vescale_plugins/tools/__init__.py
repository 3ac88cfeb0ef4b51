"""What the benchmark, the forecast, the reports and the tests share: the multi-process
launcher and the model catalogue."""
