"""The worker side of the cluster protocol: who this rank is (``context``), the control-plane
collective every rank runs at the same steps (``control_plane``), lockstep application of
cluster decisions (``lockstep``), the coordinator client (``client``) and its daemon-thread
link to the run's actors (``link``).
"""
