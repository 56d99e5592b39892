"""Finding a master on the LAN: DNS-SD over mDNS (the `zeroconf` package).

A master announces `_edgetp._tcp.local.` with its cluster name, model, protocol version and the
fingerprint of its public key in the TXT record; `edgetp join` with no address browses for it.
The fingerprint lets a node skip a master whose key is not the one its token names.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceListener, Zeroconf

SERVICE_TYPE = "_edgetp._tcp.local."


@dataclass(frozen=True)
class MasterAd:
    """What a master announces."""

    cluster: str
    model: str
    version: int
    fingerprint: str
    host: str  # the first announced address
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def _zeroconf(interface: str | None) -> Zeroconf:
    # One interface keeps mDNS where it is asked to be (tests use loopback only).
    interfaces = [interface] if interface else None
    if interfaces:
        return Zeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
    return Zeroconf(ip_version=IPVersion.V4Only)


class Announcer:
    """Announces a master until closed."""

    def __init__(self, ad: MasterAd, addresses: list[str], interface: str | None = None) -> None:
        self._zc = _zeroconf(interface)
        name = f"{ad.cluster}.{SERVICE_TYPE}"
        self._info = ServiceInfo(
            SERVICE_TYPE,
            name,
            addresses=[socket.inet_aton(a) for a in addresses],
            port=ad.port,
            properties={
                "cluster": ad.cluster,
                "model": ad.model,
                "version": str(ad.version),
                "fingerprint": ad.fingerprint,
            },
            server=f"{ad.cluster}.local.",
        )
        # A second master with the same cluster name on the LAN gets a distinct service name.
        self._zc.register_service(self._info, allow_name_change=True)

    def close(self) -> None:
        self._zc.unregister_service(self._info)
        self._zc.close()


class _Collector(ServiceListener):
    def __init__(self) -> None:
        self.names: list[str] = []

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.names.append(name)

    def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        pass

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        pass


def browse(seconds: float, interface: str | None = None) -> list[MasterAd]:
    """The masters that answer within `seconds`."""
    zc = _zeroconf(interface)
    try:
        collector = _Collector()
        browser = ServiceBrowser(zc, SERVICE_TYPE, collector)
        time.sleep(seconds)
        browser.cancel()
        ads = []
        for name in dict.fromkeys(collector.names):
            info = zc.get_service_info(SERVICE_TYPE, name, timeout=2000)
            if info is None or not info.parsed_addresses():
                continue
            props = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
            ads.append(
                MasterAd(
                    cluster=props.get("cluster", name.split(".")[0]),
                    model=props.get("model", "?"),
                    version=int(props.get("version", "0") or 0),
                    fingerprint=props.get("fingerprint", ""),
                    host=info.parsed_addresses()[0],
                    port=int(info.port or 0),
                )
            )
        return ads
    finally:
        zc.close()


def announce_addresses(bind: str, interface: str | None) -> list[str]:
    """The IPv4 addresses to announce: the mDNS interface, the bound address, or every
    non-loopback address of this device when it listens on all of them."""
    if interface:
        return [interface]
    if bind not in ("0.0.0.0", "*"):
        return [bind]
    import ifaddr  # installed with zeroconf

    found = [
        ip.ip
        for adapter in ifaddr.get_adapters()
        for ip in adapter.ips
        if isinstance(ip.ip, str) and not ip.ip.startswith("127.")
    ]
    return found or ["127.0.0.1"]
