"""The launcher process (`trainwatch launch`): its command line, the job's
start-up and clean-up, torchelastic's agent and the warm start workers are
forked from. The node sidecar it starts is `trainwatch.watchdog`."""
