"""rollmesh.scheduling"""
