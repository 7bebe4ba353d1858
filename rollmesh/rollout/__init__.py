"""rollmesh.rollout"""
