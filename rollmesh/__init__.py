"""rollmesh: asynchronous RL for long-running tool-using LLM agents."""
