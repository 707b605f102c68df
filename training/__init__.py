"""Running a training job: the loop (``trainer``) and planning one without running it (``plan``)."""
