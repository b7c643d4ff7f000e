"""What carries commands and results between a front end and engine loops: a thread, a child process, replicas."""
