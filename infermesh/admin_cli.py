"""``infermesh teams|keys|prices|budgets``: the ledger's admin commands.

    infermesh teams create NAME            infermesh teams list
    infermesh teams bus-user NAME          (the team's NATS user for batch jobs on the bus: infermesh/team_bus_users.py)
    infermesh keys create --team T [--name N] [--admin]
    infermesh keys revoke PREFIX           infermesh keys list [--team T]
    infermesh prices set --model M --input X --cached-input Y --output Z [--effective-from ISO] [--batch-percent P]
    infermesh prices list
    infermesh budgets set --team T --usd X [--month YYYY-MM]

Every command takes ``--database-url`` (default: $INFERMESH_DATABASE_URL, else the embedded SQLite file)
and migrates the ledger first. Amounts are decimal USD (prices per 1M tokens). The keys commands tell
metering over NATS when a URL is given (``--nats-url`` or $INFERMESH_NATS_URL); metering also polls, so
a failure there is only a warning. Bad input: a message on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys

from shared.nats_auth import NatsCredentials
from shared.schema import DEFAULT_BATCH_PERCENT

COMMANDS = ("teams", "keys", "prices", "budgets")
NATS_TIMEOUT_S = 5.0


class _Failed(Exception):
    """Bad command-line input found before the ledger is touched."""


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register the admin commands on the ``infermesh`` parser's subcommands."""
    database = argparse.ArgumentParser(add_help=False)
    database.add_argument("--database-url", default="",
                          help="ledger URL (default: $INFERMESH_DATABASE_URL, else the embedded SQLite file)")
    notify = argparse.ArgumentParser(add_help=False)
    notify.add_argument("--nats-url", default="", help="tell metering at once (default: $INFERMESH_NATS_URL)")
    notify.add_argument("--namespace", default="im")

    teams = _actions(commands, "teams", "teams (the unit of billing)")
    teams.add_parser("create", parents=[database], help="add a team").add_argument("name")
    teams.add_parser("list", parents=[database], help="list teams")
    teams.add_parser("bus-user", parents=[database],
                     help="the team's own NATS user for its batch jobs on the bus (infermesh/batch_client.py): made "
                          "once, added to the bus up runs here at once; prints its password on stdout").add_argument(
        "name")

    keys = _actions(commands, "keys", "API keys (stored as SHA-256; shown once)")
    create = keys.add_parser("create", parents=[database, notify], help="make a key; prints it once on stdout")
    create.add_argument("--team", required=True)
    create.add_argument("--name", default="", help="a label for the key")
    create.add_argument("--admin", action="store_true", help="the key may call the billing admin API")
    keys.add_parser("revoke", parents=[database, notify], help="revoke the key with this prefix").add_argument(
        "prefix")
    keys.add_parser("list", parents=[database], help="list keys (prefixes, never keys)").add_argument(
        "--team", default=None)

    prices = _actions(commands, "prices", "model prices, USD per 1M tokens")
    price = prices.add_parser("set", parents=[database], help="a model's price from a moment on")
    price.add_argument("--model", required=True)
    price.add_argument("--input", required=True, help="USD per 1M uncached prompt tokens")
    price.add_argument("--cached-input", required=True, help="USD per 1M cached prompt tokens")
    price.add_argument("--output", required=True, help="USD per 1M completion tokens")
    price.add_argument("--effective-from", default="", help="ISO 8601 (default: now; no offset: UTC)")
    price.add_argument("--batch-percent", type=int, default=DEFAULT_BATCH_PERCENT,
                       help=f"a batch line's price, in percent of these (default {DEFAULT_BATCH_PERCENT})")
    prices.add_parser("list", parents=[database], help="every price row; * marks those in effect now")

    budgets = _actions(commands, "budgets", "monthly budgets per team")
    budget = budgets.add_parser("set", parents=[database], help="a team's budget for a month, or every month")
    budget.add_argument("--team", required=True)
    budget.add_argument("--usd", required=True)
    budget.add_argument("--month", default="*", help="YYYY-MM (default: *, every month without its own)")


def _actions(commands: argparse._SubParsersAction, name: str, help: str) -> argparse._SubParsersAction:
    return commands.add_parser(name, help=help).add_subparsers(dest="action", required=True)


def run(args: argparse.Namespace) -> int:
    from services.metering.admin import AdminError

    try:
        return asyncio.run(_run(args))
    except (AdminError, _Failed) as exc:
        print(f"infermesh {args.command} {args.action}: {exc}", file=sys.stderr)
    except Exception as exc:  # the database unreachable, a bad URL...: one line, not a traceback
        print(f"infermesh {args.command} {args.action}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1


async def _run(args: argparse.Namespace) -> int:
    from services.metering import admin
    from services.metering.db import create_engine, database_url, migrate

    subject = _keys_changed_subject(args.namespace) if args.command == "keys" and args.action != "list" else ""
    effective_from = _instant(args.effective_from) if getattr(args, "effective_from", "") else None
    url = database_url(args.database_url)
    await migrate(url)
    engine = create_engine(url)
    try:
        if args.command == "teams":
            await _teams(engine, args)
        elif args.command == "keys":
            await _keys(engine, args)
        elif args.command == "prices" and args.action == "set":
            await admin.set_price(engine, args.model, args.input, args.cached_input, args.output, effective_from,
                                  args.batch_percent)
            print(f"price of {args.model} set")
        elif args.command == "prices":
            await _list_prices(engine)
        else:
            await admin.set_budget(engine, args.team, args.usd, args.month)
            print(f"budget of {args.team} for {args.month} set to {args.usd} USD")
    finally:
        await engine.dispose()
    if subject:
        await _announce(args.nats_url or os.environ.get("INFERMESH_NATS_URL", ""), subject)
    return 0


async def _teams(engine, args: argparse.Namespace) -> None:
    from services.metering import admin

    if args.action == "create":
        await admin.create_team(engine, args.name)
        print(f"team {args.name} created")
        return
    if args.action == "bus-user":
        if args.name not in {t["name"] for t in await admin.list_teams(engine)}:
            raise _Failed(f"no team {args.name!r} (infermesh teams create {args.name})")
        await _bus_user(args.name)
        return
    rows = [(t["name"], str(t["active_keys"]), _when(t["created_at"])) for t in await admin.list_teams(engine)]
    _table(("TEAM", "ACTIVE_KEYS", "CREATED"), rows)


async def _bus_user(team: str) -> None:
    from infermesh.bus_roles import team_user
    from infermesh.private_files import data_dir
    from infermesh.team_bus_users import add_team_user, reload_team_users, running_url, team_credentials

    password = add_team_user(data_dir(), team)
    url = running_url(data_dir()) if reload_team_users(data_dir()) else None
    if url:
        await _await_login(url, team_credentials(team, tls_ca=NatsCredentials.from_env().tls_ca))
        print(f"user {team_user(team)} may submit {team}'s batch jobs on {url} now", file=sys.stderr)
    else:
        print(f"user {team_user(team)}: the next infermesh up has it (no locked bus runs here now)", file=sys.stderr)
    print(password)


async def _await_login(url: str, credentials: NatsCredentials, timeout_s: float = 10.0) -> None:
    """Until the server, reloading its config, lets the new user in."""
    import nats

    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            nc = await nats.connect(url, **credentials.connect_options(url), allow_reconnect=False,
                                    connect_timeout=2, max_reconnect_attempts=0)
            await nc.close()
            return
        except Exception as exc:  # authorization refused until the reload is done
            if asyncio.get_running_loop().time() > deadline:
                raise _Failed(f"the bus at {url} did not take the new user within {timeout_s:.0f} s: {exc}") from None
            await asyncio.sleep(0.1)


async def _keys(engine, args: argparse.Namespace) -> None:
    from services.metering import admin

    if args.action == "create":
        key, prefix = await admin.create_key(engine, args.team, args.name, args.admin)
        print(key, flush=True)
        print(f"key {prefix}... for team {args.team}: store it now, it will not be shown again", file=sys.stderr)
    elif args.action == "revoke":
        await admin.revoke_key(engine, args.prefix)
        print(f"key {args.prefix} revoked")
    else:
        rows = [(k["prefix"], k["team"], k["name"], "yes" if k["is_admin"] else "no", _when(k["created_at"]),
                 _when(k["revoked_at"]) if k["revoked_at"] else "-") for k in await admin.list_keys(engine, args.team)]
        _table(("PREFIX", "TEAM", "NAME", "ADMIN", "CREATED", "REVOKED"), rows)


async def _list_prices(engine) -> None:
    from services.metering import admin

    now = dt.datetime.now(dt.timezone.utc)
    prices = await admin.list_prices(engine)  # by model, then start: the last started row per model is in effect
    in_effect = {p["model"]: i for i, p in enumerate(prices) if p["effective_from"] <= now}
    rows = [(p["model"], _when(p["effective_from"]),
             *(admin.micros_to_usd(p[k]) for k in ("input_micros", "cached_input_micros", "output_micros")),
             f"{p['batch_percent']}%", "*" if in_effect.get(p["model"]) == i else "") for i, p in enumerate(prices)]
    _table(("MODEL", "FROM", "INPUT", "CACHED_INPUT", "OUTPUT", "BATCH", "NOW"), rows)


def _keys_changed_subject(namespace: str) -> str:
    from shared.subjects import Subjects

    try:
        return Subjects(namespace).keys_changed
    except ValueError as exc:
        raise _Failed(str(exc)) from None


async def _announce(nats_url: str, subject: str) -> None:
    """Tell metering the keys changed, so the edges hear of it now rather than at the next poll."""
    if not nats_url:
        return
    import nats

    from infermesh.bus_auth import admin_credentials

    try:
        connection = await asyncio.wait_for(  # as admin on a bus up locked (the only role allowed to say so)
            nats.connect(nats_url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0,
                         **admin_credentials().connect_options(nats_url)),
            NATS_TIMEOUT_S)
        try:
            await connection.publish(subject, b"")
            await connection.flush(timeout=2)
        finally:
            await connection.close()
    except Exception as exc:
        print(f"warning: could not publish {subject} on {nats_url} ({type(exc).__name__}: {exc}); "
              "metering will see the change at its next poll", file=sys.stderr)


def _instant(text: str) -> dt.datetime:
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise _Failed(f"--effective-from: {text!r} is not an ISO 8601 date or time") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.timezone.utc)


def _when(moment: dt.datetime) -> str:
    return moment.astimezone(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
