"""rollmesh.training"""
