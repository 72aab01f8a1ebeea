"""The Endpoint Picker (EPP) for the Gateway API Inference Extension: docs/epp.md."""
