"""Conveyor on Ray: Ray Serve for online serving (``conveyor.ray.serve``), ray.data for batch
inference (``conveyor.ray.data``). Ray owns the replicas, their placement, restarts and autoscaling;
Conveyor provides the engine, the OpenAI front end and the prefix-aware routing policy.

Needs the ``ray`` extra (``pip install 'conveyor[ray]'``); nothing else in Conveyor imports Ray.
"""
