"""rollmesh.telemetry"""
