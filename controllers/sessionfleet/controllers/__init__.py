"""Thin kopf handlers, one module per custom resource kind.

Handlers observe, call a pure decision function from :mod:`sessionfleet.policy`,
act through :mod:`sessionfleet.kube` and write status. They hold no decisions.
"""
