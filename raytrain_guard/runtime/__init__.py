"""What runs inside every training worker: the parts (``data``, ``guard``, ``dist``) and the
loops built on them (``loop``, the shared train loop; ``dropin``, the drop-in's worker side).
Importing ``raytrain_guard.runtime`` alone pulls in neither torch nor ray.
"""
