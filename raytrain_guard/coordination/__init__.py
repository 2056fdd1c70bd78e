"""The worker side of the cluster protocol: the rank's context, the control-plane collective,
the lockstep, the coordinator client and its link to the run's actors.
"""
