"""rollmesh.engine"""
