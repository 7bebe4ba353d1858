"""rollmesh.checkpoint"""
