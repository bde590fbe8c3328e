"""Engine: scheduling, sampling and the model runner."""
