"""The HTTP front end: the Serve application (app.py: `import_path: router.app:build_app`),
its OpenAI-compatible API and the router replicas that route each request over the engine
replicas. What owns and sizes those engines, the control plane, is router/control/."""
