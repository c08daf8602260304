"""The MQTT transport: ``MqttLink`` (``felix.deploy.link``) behind the links of ``felix.deploy.transport``.

The topic scheme (``felix.deploy.topics``) stays here: a received topic becomes the
:class:`Address` it names (the broker's ACL vouches for the client id in it), a channel and
client become a topic, and STATUS is retained for late joiners. Conversion happens on paho's
network thread, so the loop sees deliveries only.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from felix.deploy.channels import Address, Channel
from felix.deploy.link import BrokerOptions, Connected, Inbound, MqttLink
from felix.deploy.shards import ShardedServerLink, client_broker
from felix.deploy.topics import Topics
from felix.deploy.transport import (
    TRANSPORTS,
    Ack,
    BatchSink,
    ClientLinkArgs,
    Delivery,
    ServerLinkArgs,
    Sink,
)

AddressOf = Callable[[str], Address | None]


def _delivery(m: Inbound, address_of: AddressOf, shard: int) -> Delivery:
    return Delivery(address_of(m.topic), m.payload, Ack(m.mid, m.qos, m.epoch, shard), m.topic, m.received_at)


def _sinks(
    sink: Sink, batch_sink: BatchSink, address_of: AddressOf, shard: int = 0
) -> tuple[Callable[[Inbound | Connected], None], Callable[[list[Inbound]], bool]]:
    def one(item: Inbound | Connected) -> None:
        if isinstance(item, Connected):
            sink(dataclasses.replace(item, shard=shard) if shard else item)
        else:
            sink(_delivery(item, address_of, shard))

    def batch(items: list[Inbound]) -> bool:
        return batch_sink([_delivery(m, address_of, shard) for m in items])

    return one, batch


class MqttServerLink:
    """The server's MQTT connection: it subscribes to every client's inbound topics and
    acknowledges only when told (after the checkpoint that holds a message's effect). ``shard``:
    which broker of a sharded deployment this is (``felix.deploy.shards``), carried by its
    deliveries and connection notices."""

    def __init__(self, args: ServerLinkArgs, shard: int = 0) -> None:
        self.topics = Topics(args.run_id)
        self.broker = args.options.address
        one, batch = _sinks(args.sink, args.batch_sink, self.topics.parse_inbound_to_server, shard)
        self.mqtt = MqttLink(
            f"felix-{args.run_id}-server",
            dataclasses.replace(args.options, receive_maximum=args.receive_maximum),
            self.topics.server_subscriptions(),
            one,
            manual_ack=True,
            batch_sink=batch,
        )

    @property
    def connected(self) -> bool:
        return self.mqtt.connected

    def start(self, fresh: bool, stop: threading.Event | None = None) -> None:
        self.mqtt.start(fresh=fresh, wait_subscribed=False, stop=stop)

    def ready(self) -> bool:
        return self.mqtt.subscribed()

    def send(self, channel: Channel, client: int | None, payload: bytes) -> None:
        self.mqtt.publish(self.topics.to_clients(channel, client), payload, retain=channel is Channel.STATUS)

    def ack(self, acks: list[Ack]) -> None:
        self.mqtt.ack_many([(a.token, a.qos, a.epoch) for a in acks])

    def close(self, timeout: float = 5.0) -> None:
        self.mqtt.close(timeout)

    def connections(self) -> list[tuple[str, bool]]:
        return [(self.broker, self.mqtt.connected)]


class MqttClientLink:
    """One client's MQTT connection (its login is its client id): its task topic and the status in."""

    def __init__(self, args: ClientLinkArgs) -> None:
        self.topics = Topics(args.run_id)
        self.client = args.client
        status = self.topics.status

        def address_of(topic: str) -> Address:
            return Address(Channel.STATUS if topic == status else Channel.TASK, args.client)

        one, batch = _sinks(args.sink, args.batch_sink, address_of)
        self.mqtt = MqttLink(
            f"felix-{args.run_id}-c{args.client}",
            args.options,
            self.topics.client_subscriptions(args.client),
            one,
            batch_sink=batch,
        )

    @property
    def connected(self) -> bool:
        return self.mqtt.connected

    def _topic(self, channel: Channel) -> str:
        if channel is Channel.REGISTER:
            return self.topics.register(self.client)
        if channel is Channel.STATE:
            return self.topics.state(self.client)
        if channel is Channel.SECAGG:
            return self.topics.secagg(self.client)
        assert channel is Channel.RESULT, channel
        return self.topics.result(self.client)

    def set_will(self, channel: Channel, builder: Callable[[int], bytes], delay_s: int) -> None:
        topic = self._topic(channel)
        self.mqtt.set_will(lambda epoch: (topic, builder(epoch)), delay_s)

    def start(self, fresh: bool) -> None:
        self.mqtt.start(fresh=fresh)

    def send(self, channel: Channel, payload: bytes) -> None:
        self.mqtt.publish(self._topic(channel), payload)

    def close(self, timeout: float = 5.0) -> None:
        self.mqtt.close(timeout)


class MqttTransport:
    """One broker, or several (``BrokerOptions.shards``): the server then links to each, and a
    client to its shard's broker only (``felix.deploy.shards``)."""

    options = BrokerOptions

    def server_link(self, args: ServerLinkArgs) -> MqttServerLink | ShardedServerLink:
        return ShardedServerLink(args) if args.options.shards else MqttServerLink(args)

    def client_link(self, args: ClientLinkArgs) -> MqttClientLink:
        return MqttClientLink(dataclasses.replace(args, options=client_broker(args.options, args.client)))


TRANSPORTS.register("mqtt")(MqttTransport())
