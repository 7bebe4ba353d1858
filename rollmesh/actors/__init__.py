"""rollmesh.actors"""
