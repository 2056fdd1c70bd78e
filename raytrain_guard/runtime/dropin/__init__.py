"""The worker side of the drop-in (:mod:`raytrain_guard.train`) for a loop the user wrote.
"""
