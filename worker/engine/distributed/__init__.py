"""A job on several devices: ``ranks`` (the process group, gradients averaged, one rank's
view of the batch) and ``launch`` (a process a rank)."""
