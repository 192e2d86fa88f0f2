"""The control plane: what owns and sizes an application's engine replicas, apart from the
HTTP front end (router/) that routes requests over them.

The EngineController (controller.py, one Serve replica) resolves the model (model.py), then
runs the EngineFleet (fleet.py): it places each engine actor (placement.py), brings it up,
joins it to the KV handoff, health-checks and restarts it, and publishes the Membership
(membership.py) that every router replica long-polls. With `planner.enabled`, the
PlannerLoop (planner_loop.py) resizes the tiers from the routers' reports through drains,
adds and role flips (tier_changes.py). The engines are detached, named and leased actors
(engines.py): they outlive the controller's replica, whose replacement adopts them, and
stop when Serve stops the application, or by themselves once nobody renews their leases.
"""
