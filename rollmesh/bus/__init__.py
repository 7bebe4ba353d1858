"""rollmesh.bus"""
