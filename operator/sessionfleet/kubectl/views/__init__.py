"""What ``kubectl sessionfleet`` shows, built from the objects: pure functions.

The plugin's I/O layer (:mod:`sessionfleet.kubectl.cli`) reads objects from the API
server and hands them here as the JSON it answered; these modules parse them with the
API models, decide what to say and return rows, text or JSON-ready dicts. The time is
a parameter, so every countdown is tested without a clock.

Nothing is decided twice: the DrainPolicy that governs a worker is resolved with the
operator's own :func:`~sessionfleet.policy.drain.resolve_policy`; where a session would
go now is :func:`~sessionfleet.policy.placement.place` over loads built the way the
operator builds them; where a drain would move each pinned session is the operator's
own :func:`~sessionfleet.policy.migration.plan_migration`; which sessions hold a worker,
which workers take new sessions and a session's context are the rules of
:mod:`sessionfleet.policy.holds`.

One module per part of the output:

- :mod:`.format`: times, token counts, percentages and tables, as kubectl writes them;
- :mod:`.snapshot`: the objects read at one moment, parsed, and what could not be;
- :mod:`.sessions`: ``sessions``; :mod:`.status` and :mod:`.workers`: ``status``, a
  worker's policy and drain;
- :mod:`.placement`: where a session would go now; :mod:`.migration`: where a drained
  worker's sessions would move now; :mod:`.events`: Events and conditions;
- :mod:`.explain`: ``explain session``; :mod:`.drain`: ``drain`` and ``undrain``;
  :mod:`.checkpoints`: ``checkpoint``.
"""
