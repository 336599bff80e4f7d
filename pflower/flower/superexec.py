"""The warm SuperExec's touches of Flower's SuperExec and ClientApp runtime
(``pflower.deploy.warm_exec``: every task in a fork of a process that imported torch, Flower
and the app once).

Flower has no public route to a warm ClientApp process (its warm pools are Kubernetes-only),
so the warm SuperExec uses, as Flower 1.41 has them:

- ``flwr.supercore.superexec.run_superexec``: its loop as it is, with the executor it builds
  through the module's ``get_executor`` replaced (``use_executor``); the executor protocol's
  ``TaskType`` and ``LaunchResult`` (``launch``);
- ``flwr.supernode.runtime.run_clientapp``: ``run_clientapp`` (what a ``flwr-clientapp``
  process runs; ``run_task``) with the keywords ``RUN_CLIENTAPP_KEYWORDS``, and, in a task's
  child only, its Runtime API client class and ``push_message`` wrapped to note how far the
  task got and to keep the reply it pushes (``note_progress``: the reply's objects as
  ``push_message`` pushes them, Flower's ``get_all_nested_objects`` and each object's
  ``deflate``, and the context its exit pushes); its ``push_message`` and ``push_task_output``
  to answer for a child that was killed (``answer_failed``), ``push_task_output`` to end the
  task of a child killed while it pushed its reply (``complete_push``);
- ``flwr.proto``: the Runtime API's ``PushMessages`` (its response's ``session_id`` and
  ``objects_to_push``), ``PushObject`` (with ``session_id``) and ``ConfirmMessageReceived``
  requests, which ``complete_push`` and ``drop_reply`` send as ``push_message`` does
  (``PUSH_FIELDS``);
- ``flwr.supercore.tls``, ``flwr.supercore.interceptors``, ``flwr.supercore.retry``,
  ``flwr.supercore.runtime``: a Runtime API client with a task's token, built as
  ``run_clientapp`` builds its own (``runtime_client``).

When an upgrade changes them: ``cannot_warm`` checks them when the warm SuperExec starts and
names what changed; Flower's own SuperExec then runs each task in a fresh ``flwr-clientapp``
(cold, as without pflower), said in one line. A task whose ``run_clientapp`` fails in the fork
prints its traceback and ends with code 1 (``warm_exec._run_task``); an answer for a killed
child that fails is said in the log. Checked on Flower ``pflower.flower.CHECKED``. Nothing
here is imported from Flower until a function is called.
"""

from __future__ import annotations

import importlib
import inspect

SUPEREXEC = "flwr.supercore.superexec.run_superexec"
RUN_CLIENTAPP = "flwr.supernode.runtime.run_clientapp"
TLS = "flwr.supercore.tls"
#: what a task imports of Flower's: the warm SuperExec's zygote imports them before any fork
TASK_MODULES = (RUN_CLIENTAPP, TLS)
#: what ``run_task`` passes Flower's ``run_clientapp`` (checked by ``cannot_warm``)
RUN_CLIENTAPP_KEYWORDS = (
    "runtime_api_address",
    "token",
    "insecure",
    "certificates",
    "parent_pid",
    "runtime_dependency_install",
)
#: what ``note_progress`` wraps and uses, and ``answer_failed`` and ``complete_push`` call, in
#: Flower's run_clientapp module
RUN_CLIENTAPP_HOOKS = (
    "RuntimeHttpClient",
    "push_message",
    "push_task_output",
    "get_all_nested_objects",
)
#: the Runtime API's messages and the fields ``complete_push`` and ``drop_reply`` use
PUSH_FIELDS = {
    "flwr.proto.runtime_pb2.PushAppMessagesRequest": ("messages_list", "message_object_trees"),
    "flwr.proto.runtime_pb2.PushAppMessagesResponse": ("objects_to_push", "session_id"),
    "flwr.proto.message_pb2.PushObjectRequest": (
        "node", "run_id", "object_id", "object_content", "session_id",
    ),
    "flwr.proto.message_pb2.PushObjectResponse": ("stored",),
    "flwr.proto.message_pb2.ConfirmMessageReceivedRequest": (
        "node", "run_id", "message_object_id",
    ),
}  # fmt: skip


def superexec_module():
    """Flower's ``run_superexec`` module (its loop, and the ``get_executor`` it builds its
    executor with)."""
    return importlib.import_module(SUPEREXEC)


def runtime_module():
    """Flower's ``run_clientapp`` module, looked up at each call (tests replace its names)."""
    return importlib.import_module(RUN_CLIENTAPP)


def use_executor(superexec, executor) -> None:
    """Make ``superexec``'s loop run its tasks with ``executor`` (pflower's hook: the loop
    builds its executor with its module's ``get_executor``; checked by ``cannot_warm``)."""
    superexec.get_executor = lambda *a, **k: executor


def cannot_warm(superexec) -> str | None:
    """Why this Flower's SuperExec cannot take the fork executor, or None: it must read
    ``get_executor`` from its module (``use_executor``), ``run_clientapp`` must take the
    keywords ``run_task`` calls it with, its module must have ``RUN_CLIENTAPP_HOOKS``, its
    ``push_message`` must push through the client's ``PushMessages`` and ``PushObject`` the
    objects of ``get_all_nested_objects`` (what ``note_progress`` keeps), and the Runtime API's
    messages must have ``PUSH_FIELDS``."""
    try:
        if "get_executor(" not in inspect.getsource(superexec.run_superexec):
            return "this Flower's run_superexec no longer asks get_executor for its executor"
        importlib.import_module(TLS).validate_and_resolve_root_certificates  # noqa: B018
        module = runtime_module()
        inspect.signature(module.run_clientapp).bind(**dict.fromkeys(RUN_CLIENTAPP_KEYWORDS))
        missing = [n for n in RUN_CLIENTAPP_HOOKS if not callable(getattr(module, n, None))]
        if missing:
            return f"this Flower's run_clientapp module has no {missing[0]}"
        pushes = inspect.getsource(module.push_message)
        for call in ("client.PushMessages(", "client.PushObject", "get_all_nested_objects("):
            if call not in pushes:  # note_progress keeps the reply from what these see
                return f"this Flower's push_message no longer calls {call.rstrip('(')}"
        for path, fields in PUSH_FIELDS.items():
            where, name = path.rsplit(".", 1)
            known = getattr(importlib.import_module(where), name).DESCRIPTOR.fields_by_name
            if lost := [f for f in fields if f not in known]:
                return f"this Flower's {name} has no field {lost[0]}"
    except TypeError as err:
        return f"this Flower's run_clientapp takes other arguments ({err})"
    except Exception as err:  # moved, renamed, shipped without source
        return f"this Flower's SuperExec is not the one checked ({type(err).__name__}: {err})"
    return None


def launch(spec, submit):
    """The executor protocol's ``launch``: ``submit`` the task's spec (a dict) for a
    ClientApp task; Flower's ``LaunchResult``."""
    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor.types import LaunchResult

    if spec.task_type != TaskType.CLIENT_APP:  # a SuperNode only asks for ClientApps
        return LaunchResult.failed(f"the warm executor runs ClientApps, not {spec.task_type}")
    submit(
        {
            "runtime_api_address": spec.runtime_api_address,
            "token": spec.token,
            "insecure": spec.insecure,
            "root_certificates_path": spec.root_certificates_path,
            "parent_pid": spec.parent_pid,
            "runtime_dependency_install": spec.runtime_dependency_install,
        }
    )
    return LaunchResult.accepted()


def _certificates(spec: dict):
    from flwr.supercore.tls import validate_and_resolve_root_certificates

    return validate_and_resolve_root_certificates(spec["root_certificates_path"], spec["insecure"])


def run_task(spec: dict) -> None:
    """Flower's ``run_clientapp`` for the task ``spec`` (what ``launch`` submitted): it pulls
    the message, installs the FAB, loads the app, pushes the reply; it ends with Flower's
    ``flwr_exit`` (``SystemExit``)."""
    runtime_module().run_clientapp(
        runtime_api_address=spec["runtime_api_address"],
        token=spec["token"],
        insecure=spec["insecure"],
        certificates=_certificates(spec),
        parent_pid=spec["parent_pid"],
        runtime_dependency_install=spec["runtime_dependency_install"],
    )


def note_progress(pulled_task, took_message, pushing, push_began, object_sent, pushed) -> None:
    """In a task's child, before ``run_task``: call ``pulled_task(run, task, node)`` once
    ``run_clientapp`` has pulled its task, ``took_message(message)`` (without its content)
    once it has taken its message; ``pushing(reply, reply_id)`` when its reply's push starts,
    before the Runtime API's ``PushMessages`` (``reply``: what ``complete_push`` needs to
    finish that push, ``kept_reply``), ``push_began(session_id, object_ids)`` with that call's
    answer (the push session and the objects the SuperNode asked for), ``object_sent(id)`` as
    each ``PushObject`` is stored (from Flower's pushing threads) and ``pushed()`` when the
    push has ended. Wraps, in this child only, the Runtime API client class ``run_clientapp``
    builds and its ``push_message``."""
    from flwr.common.serde import message_from_proto

    flower = runtime_module()
    push = flower.push_message
    replying = []  # the (reply, context) push_message is pushing

    class NotingClient(flower.RuntimeHttpClient):
        def PullTaskInput(self, request):
            res = super().PullTaskInput(request)
            pulled_task(res.run.run_id, res.task_id, res.context.node_id)
            return res

        def PullMessages(self, request):
            res = super().PullMessages(request)
            if res.messages_list:
                message = message_from_proto(res.messages_list[0])
                # as Flower's pull_task_input: a message's id is its tree's root
                message.metadata.__dict__["_message_id"] = res.message_object_trees[0].object_id
                took_message(message)
            return res

        def PushMessages(self, request):
            reply = kept_reply(request, *replying.pop()) if replying else None
            pushing(reply, request.message_object_trees[0].object_id)
            res = super().PushMessages(request)
            push_began(res.session_id, list(res.objects_to_push))
            return res

        def PushObject(self, request):
            res = super().PushObject(request)
            if res.stored:
                object_sent(request.object_id)
            return res

    def push_message(client, message, context):
        replying.append((message, context))
        push(client, message, context)
        pushed()

    flower.RuntimeHttpClient, flower.push_message = NotingClient, push_message


def kept_reply(request, message, context) -> dict:
    """What ``complete_push`` needs to finish the push of ``message`` (a reply) that
    ``request`` (Flower's ``PushMessages``) starts: the request, each of the message's objects
    as ``push_message`` pushes it (id: its ``deflate()``; called inside ``push_message``, whose
    ``no_object_id_recompute`` keeps the ids it computed), and what the task's end reports:
    its context (``run_clientapp`` pushes it at exit, unchanged since the push) and its status
    (``run_clientapp``'s: COMPLETED, or FAILED with the reason of an error reply)."""
    from flwr.common.constant import SubStatus
    from flwr.common.serde import context_to_proto

    objects = runtime_module().get_all_nested_objects(message)
    failed = message.has_error()
    return {
        "request": request.SerializeToString(),
        "objects": {object_id: obj.deflate() for object_id, obj in objects.items()},
        "context": context_to_proto(context).SerializeToString(),
        "node": context.node_id,
        "run": context.run_id,
        "status": SubStatus.FAILED if failed else SubStatus.COMPLETED,
        "details": message.error.reason if failed else "",
    }


def complete_push(client, reply: dict, session_id: str | None, to_push, sent) -> tuple[int, int]:
    """Finish, through ``client`` (the task's token), the push of a reply its child began
    (``reply``: ``kept_reply``) and end its task as ``run_clientapp`` would have. Where the
    SuperNode had answered its ``PushMessages`` (``session_id``, ``to_push``), the objects it
    asked for that were not stored yet (not in ``sent``) are pushed in that session; else the
    ``PushMessages`` is sent again (a SuperNode that holds the message keeps it, and answers
    with the objects it still lacks in a new session), then those objects. A SuperNode
    stores an object only while its session waits for it: pushed twice, nothing changes.
    Returns (objects stored, objects pushed)."""
    from flwr.common.serde import context_from_proto
    from flwr.proto.message_pb2 import Context as ContextProto  # pylint: disable=E0611
    from flwr.proto.message_pb2 import PushObjectRequest  # pylint: disable=E0611
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
    from flwr.proto.runtime_pb2 import PushAppMessagesRequest  # pylint: disable=E0611

    if session_id is None:  # cut off before the SuperNode answered (or heard) its PushMessages
        res = client.PushMessages(PushAppMessagesRequest.FromString(reply["request"]))
        session_id, lacking = res.session_id, list(res.objects_to_push)
    else:
        lacking = [object_id for object_id in to_push if object_id not in sent]
    stored = 0
    for object_id in lacking:
        res = client.PushObject(
            PushObjectRequest(
                node=Node(node_id=reply["node"]), run_id=reply["run"], object_id=object_id,
                object_content=reply["objects"][object_id], session_id=session_id,
            )
        )  # fmt: skip
        stored += bool(res.stored)
    context = context_from_proto(ContextProto.FromString(reply["context"]))
    runtime_module().push_task_output(client, context, reply["status"], reply["details"])
    return stored, len(lacking)


def drop_reply(client, run_id: int, node_id: int, reply_id: str, reason: str) -> None:
    """For a reply whose push was cut off and whose objects were not kept: remove its objects
    from the SuperNode's store (``ConfirmMessageReceived``, which deletes the tree under the
    id it is given) so that the SuperNode's send of it, waiting for them, fails and it goes
    on, then end the task FAILED (``reason``)."""
    from flwr.common.constant import SubStatus
    from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest  # pylint: disable=E0611
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611

    client.ConfirmMessageReceived(
        ConfirmMessageReceivedRequest(
            node=Node(node_id=node_id), run_id=run_id, message_object_id=reply_id
        )
    )
    runtime_module().push_task_output(client, None, SubStatus.FAILED, reason)


def runtime_client(spec: dict, max_tries: int = 3):
    """A client of the SuperNode's Runtime API with a task's token, as Flower's
    ``run_clientapp`` builds it (``max_tries`` per call: a dead task's answer must not
    hang)."""
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    retry_invoker = make_simple_http_retry_invoker()
    retry_invoker.max_tries = max_tries
    return RuntimeHttpClient.from_server_address(
        server_address=spec["runtime_api_address"],
        insecure=spec["insecure"],
        root_certificates=_certificates(spec),
        interceptors=[RuntimeTokenHttpInterceptor(spec["token"])],
        retry_invoker=retry_invoker,
    )


def take_message(client):
    """The task's message, taken through ``client`` (for a child that died before it took
    it); None where there is none to take."""
    from flwr.common.serde import message_from_proto
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest  # pylint: disable=E0611

    pulled = client.PullMessages(PullAppMessagesRequest())
    return message_from_proto(pulled.messages_list[0]) if pulled.messages_list else None


def answer_failed(client, message, reason: str) -> None:
    """What Flower's ``run_clientapp`` does for a ClientApp that fails, through ``client``:
    an error reply to ``message`` (``CLIENT_APP_CRASHED``, ``reason``), then the task's end
    (FAILED)."""
    from flwr.app import Context, Error, Message, RecordDict
    from flwr.common.constant import ErrorCode, SubStatus

    flower = runtime_module()
    reply = Message(Error(code=ErrorCode.CLIENT_APP_CRASHED, reason=reason), reply_to=message)
    context = Context(
        run_id=message.metadata.run_id, node_id=message.metadata.dst_node_id,
        node_config={}, state=RecordDict(), run_config={},
    )  # fmt: skip
    flower.push_message(client, reply, context)
    flower.push_task_output(client, None, SubStatus.FAILED, reason)
