"""`specfork serve --replicas R`: R engines behind one OpenAI-compatible endpoint, as a Ray Serve
deployment. Each replica is a whole `specfork serve` (its own model, KV pool, prefix cache and
engine loop, `specfork/server.py`'s routes); Ray's HTTP proxy spreads requests over them and
streams pass through. Ray is the cluster layer: on one machine it starts a local instance, on
many it joins one (`ray start --head` there, `--ray-address` here).
"""
from __future__ import annotations

import concurrent.futures
import signal
import sys
import threading

from specfork.errors import SpecforkError

REPLICA_HEADER = "x-specfork-replica"     # which replica answered (tests, load balancers)


class _Tag:
    """ASGI middleware: every HTTP response names the replica that made it."""

    def __init__(self, app, replica: str):
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(msg):
            if msg["type"] == "http.response.start":
                msg["headers"] = list(msg.get("headers", [])) + [
                    (REPLICA_HEADER.encode(), self.replica)]
            await send(msg)

        await self.app(scope, receive, tagged)


class Replica:
    """One engine inside a Ray Serve replica. The model loads on the thread that then steps the
    engine, the only thread of this process that runs torch ops (see server.EngineLoop)."""

    def __init__(self, load, serving: dict, model_name: str, max_waiting: int, threads: int):
        from specfork.server import Server, freeze_startup_objects, unfreeze
        ready: concurrent.futures.Future = concurrent.futures.Future()

        def main():
            import torch
            torch.set_num_threads(threads)
            try:
                dec = load()
                dec.serving(**serving)
                server = Server(dec, model_name, max_waiting, engine_thread=False)
                freeze_startup_objects()
            except BaseException as e:
                ready.set_exception(e)
                return
            ready.set_result(server)
            try:
                server.loop.run()
            finally:
                unfreeze()

        threading.Thread(target=main, name="specfork-engine", daemon=True).start()
        self.server = ready.result()

    def __serve_build_asgi_app__(self):
        from ray import serve

        from specfork.server import build_app
        app = build_app(self.server)
        app.add_middleware(_Tag, replica=serve.get_replica_context().replica_id.unique_id)
        return app


def serve_replicas(load, serving: dict, model_name: str, host: str, port: int,
                   max_waiting: int, replicas: int, address: str | None, gpu: bool) -> None:
    """Deploy `replicas` engines on Ray Serve at http://host:port and wait for SIGINT/SIGTERM.
    `gpu`: each replica gets a GPU of its own (Ray hides the others from it)."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpecforkError("--replicas needs Ray Serve: pip install 'specfork[replicas]'") \
            from None
    import logging
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    local = {} if address else {"_node_ip_address": "127.0.0.1"}   # this machine only
    ray.init(address=address, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", configure_logging=False, **local)
    try:
        cpus = ray.cluster_resources().get("CPU", 1.0)
        share = cpus / replicas if address is None else max(1.0, cpus // replicas)
        serve.start(http_options={"host": host, "port": port},
                    logging_config={"log_level": "ERROR"})
        dep = serve.deployment(serve.ingress()(Replica)).options(
            name="specfork", num_replicas=replicas,
            max_ongoing_requests=serving["max_batch"] + max_waiting,
            ray_actor_options={"num_cpus": share, **({"num_gpus": 1} if gpu else {})},
            health_check_period_s=10, graceful_shutdown_timeout_s=5)
        serve.run(dep.bind(load, serving, model_name, max_waiting, max(1, int(share))),
                  name="specfork", route_prefix="/")
        print(f"specfork: serving '{model_name}' on http://{host}:{port}/v1 "
              f"({replicas} replicas)", file=sys.stderr, flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
