"""Names shared by the KV connector inside vLLM and the operator that configures and asks it."""

from typing import Final

CONNECTOR_CLASS: Final = "SessionfleetKVConnector"
"""The connector's class, as ``--kv-transfer-config`` names it (``kv_connector``)."""
CONNECTOR_MODULE: Final = "sessionfleet.kvstore.connector"
"""The module vLLM imports it from (``kv_connector_module_path``)."""
TOKEN_ENV: Final = "SESSIONFLEET_KVSTORE_TOKEN"
"""The token the operator's control requests carry: the InferenceWorker's UID.

Reading it takes read access to the worker or its pods; a client of the router has none.
"""
CONTROL_KEY: Final = "sessionfleet"
"""The key of the operator's control requests in ``kv_transfer_params``."""
