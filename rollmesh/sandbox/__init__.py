"""rollmesh.sandbox"""
