"""The operator process (``sessionfleet operator``).

Its entry point is :mod:`.main`: flags, leader election (:mod:`.leader`), the checkpoint
drivers' operator half (:mod:`.drivers`) and kopf's start. The reconcilers it runs are
its controllers, in the top folder ``controllers/`` (:mod:`sessionfleet.controllers`);
everything they decide is in :mod:`sessionfleet.policy`, shared with every other process.
"""
