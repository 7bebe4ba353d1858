"""rollmesh.serve_apps"""
