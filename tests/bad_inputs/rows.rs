//! The rows of `tests/bad_inputs.rs`: every bad input, where it goes, what must come back and
//! what the user reads.

use super::{Admin, Body, Expect, Input, Row, SpecialFile, TOKEN, patch};

/// POST /v1/replay/clear with the token and a JSON body.
const fn clear(body: &'static str) -> Input {
    Input::Admin(Admin {
        method: "POST",
        path: "/v1/replay/clear",
        body: Body::Text(body),
        token: Some(TOKEN),
        content_type: Some("application/json"),
    })
}

pub(super) fn rows() -> Vec<Row> {
    use Expect::{Exit, Http};
    use Input::{Cli, Config, Dataset, DatasetFile};
    let row = |input, expect, message| Row {
        input,
        expect,
        message,
    };
    vec![
        // Config files: one line naming the file, the key and what was expected.
        row(
            Config("[rollout]\ngroup_sise = 4"),
            Exit(1),
            "rollout.group_sise: unknown key",
        ),
        row(
            Config("[rollout]\ngroup_size = \"four\""),
            Exit(1),
            "rollout.group_size",
        ),
        // `sluice check` refuses what `sluice run` would refuse.
        row(
            Config("[engine]\nbackend = \"simulated\"\n[trainer.simulated]\nenabled = false"),
            Exit(1),
            "trainer.simulated.enabled: expected true with engine.backend = \"simulated\"",
        ),
        // A rubric may weight only functions its task has.
        row(
            Config(
                "[data]\ndatasets = [\"math::arithmetic\"]\n[data.domains.math.rubric]\nweights = { corect = 1.0 }",
            ),
            Exit(1),
            "data.domains.math.rubric.weights.corect: task `arithmetic` has no reward function `corect`; it has: correct, format, env, env.<name>, length",
        ),
        row(
            Config(
                "[data]\ndatasets = [\"code::a\", \"code::b\"]\n[data.domains.code]\nenv_url = \"http://127.0.0.1:9\"",
            ),
            Exit(1),
            "data.domains.code.task: the domain's datasets name several tasks (a, b)",
        ),
        row(
            Config("[rollout]\ngroup_size = 0"),
            Exit(1),
            "rollout.group_size: expected an integer ≥ 1, got 0",
        ),
        row(
            Config("[rollout\ngroup_size = 4"),
            Exit(1),
            "line 1, column 9: invalid TOML",
        ),
        row(
            Config("[rollout]\nweight_update_mode = \"sometimes\""),
            Exit(1),
            "rollout.weight_update_mode",
        ),
        row(
            Config("[rollout]\nstaleness_threshold = -1.0"),
            Exit(1),
            "rollout.staleness_threshold",
        ),
        row(
            Config("[admin]\nlisten = \"0.0.0.0:9401\""),
            Exit(1),
            "admin.listen: 0.0.0.0:9401 is not a loopback address; set admin.token",
        ),
        row(
            Config("[admin]\nlisten = \"127.0.0.1:9400\""),
            Exit(1),
            "is also metrics.listen",
        ),
        row(
            Config("[admin]\ntoken = \"  \""),
            Exit(1),
            "admin.token: expected a non-empty token",
        ),
        row(
            Config("[trainer]\nminibatches = 0"),
            Exit(1),
            "trainer.minibatches: expected an integer ≥ 1, got 0",
        ),
        row(
            Config("[supervision]\nenv_step_timeout_s = 0"),
            Exit(1),
            "supervision.env_step_timeout_s: expected a number of seconds > 0, got 0",
        ),
        row(
            Config("[faults]\nenv_hang_every_steps = -1"),
            Exit(1),
            "faults.env_hang_every_steps: expected an integer ≥ 0, got -1",
        ),
        // Numbers past any sane value: refused with the key and the bound, never a panic
        // (`Duration::from_secs_f64`) or an allocation abort at run time.
        row(
            Config("[supervision]\nenv_step_timeout_s = 1e300"),
            Exit(1),
            "supervision.env_step_timeout_s: expected at most 604800 (seconds; a week at most), got 1e300",
        ),
        row(
            Config("[engine]\nrequest_timeout_s = 1e300"),
            Exit(1),
            "engine.request_timeout_s: expected at most 604800",
        ),
        row(
            Config("[trainer.simulated]\nstep_base_seconds = 1e300"),
            Exit(1),
            "trainer.simulated.step_base_seconds: expected at most 3600 (simulated seconds; an hour at most), got 1e300",
        ),
        row(
            Config("[engine.simulated]\ndecode_step_base_seconds = 1e300"),
            Exit(1),
            "engine.simulated.decode_step_base_seconds: expected at most 3600",
        ),
        row(
            Config("[engine]\nreplicas = 100000"),
            Exit(1),
            "engine.replicas: expected at most 256 (engine replicas on one node), got 100000",
        ),
        row(
            Config("[rollout]\nmax_version_lag = 2000000"),
            Exit(1),
            "rollout.max_version_lag: expected at most 1000000 (policy versions), got 2000000",
        ),
        row(
            Config("[admin]\ntoken = \"<redacted>\""),
            Exit(1),
            "admin.token: `<redacted>` is the placeholder `sluice check` prints",
        ),
        row(
            Config("[trainer]\nminibatches = 16\n[rollout]\ngroups_per_step = 8"),
            Exit(1),
            "trainer.minibatches: expected at most rollout.groups_per_step (8)",
        ),
        // Dataset lines: file and line number, and what was wrong.
        row(
            Dataset("{\"q\": 1}\n{\"q\": "),
            Exit(1),
            "toy.jsonl:2: invalid JSON",
        ),
        row(
            Dataset("[1, 2]"),
            Exit(1),
            "toy.jsonl:1: expected a JSON object, got an array",
        ),
        row(
            Dataset("{\"id\": [1]}"),
            Exit(1),
            "`id` must be a string or an integer, got an array",
        ),
        row(
            Dataset("\n\n{\"system_prompt\": 3}"),
            Exit(1),
            "toy.jsonl:3: `system_prompt` must be a string, got a number",
        ),
        // Files are bounded: only regular files are read, and no line or file past its cap.
        row(
            DatasetFile(SpecialFile::Bytes(b"{\"q\": 1}\n{\"q\": \"\xff\"}\n")),
            Exit(1),
            "toy.jsonl:2: not UTF-8 text (invalid byte at column 8)",
        ),
        row(
            DatasetFile(SpecialFile::LongLine(20 << 20)),
            Exit(1),
            "toy.jsonl:2: line is 20971520 bytes, longer than data.max_line_bytes = 16777216",
        ),
        row(
            DatasetFile(SpecialFile::DevZero),
            Exit(1),
            "toy.jsonl: is a character device, not a regular file",
        ),
        row(
            DatasetFile(SpecialFile::Fifo),
            Exit(1),
            "toy.jsonl: is a FIFO, not a regular file",
        ),
        row(
            Cli(&["check", "/dev/zero"]),
            Exit(1),
            "/dev/zero: cannot read config: is a character device, not a regular file",
        ),
        // The CLI refuses what it can before calling, and says when it cannot reach the node.
        row(
            Cli(&["knobs", "--url", "{url}", "set", "paused=yes"]),
            Exit(1),
            "paused: expected true or false, got `yes`",
        ),
        row(
            Cli(&["knobs", "--url", "{url}", "set", "stalenes_threshold=1"]),
            Exit(1),
            "stalenes_threshold: unknown knob",
        ),
        row(
            Cli(&[
                "knobs",
                "--url",
                "{url}",
                "--token",
                "nope",
                "set",
                "paused=false",
            ]),
            Exit(1),
            "admin API answered 401: wrong bearer token",
        ),
        row(
            Cli(&["pause", "--url", "{url}"]),
            Exit(1),
            "admin API answered 401: missing bearer token",
        ),
        row(
            Cli(&["knobs", "--url", "{url}", "set", "domain_mix={\"math\": 1}"]),
            Exit(1),
            "domain_mix: set one domain per assignment: `domain_mix.<domain>=<weight>`",
        ),
        // A domain the sampler does not serve would stall the run without a word.
        row(
            Cli(&[
                "knobs",
                "--url",
                "{url}",
                "--token",
                TOKEN,
                "set",
                "domain_mix.nonexistent=0.5",
            ]),
            Exit(1),
            "admin API answered 400: domain_mix.nonexistent: unknown domain; the sampler serves: sim",
        ),
        row(
            Cli(&["status", "--url", "http://127.0.0.1:1"]),
            Exit(1),
            "cannot connect",
        ),
        row(
            Cli(&["status", "--url", "https://{url}"]),
            Exit(1),
            "only http:// URLs are supported",
        ),
        // The admin API: 4xx, a JSON reason, and nothing changed.
        row(
            patch("{\"paused\": tru"),
            Http(400, "invalid_json"),
            "invalid JSON: EOF while parsing a value at line 1 column 14",
        ),
        row(
            patch("[1, 2]"),
            Http(400, "invalid_json"),
            "invalid knob patch: expected a JSON object of knobs, got an array",
        ),
        row(
            patch("{\"no_such_knob\": 1}"),
            Http(400, "invalid_json"),
            "unknown field `no_such_knob`",
        ),
        row(
            patch("{\"paused\": \"yes\"}"),
            Http(400, "invalid_json"),
            "invalid knob patch: `paused`: invalid type: string \"yes\", expected a boolean",
        ),
        row(
            patch("{\"max_version_lag\": -1}"),
            Http(400, "invalid_json"),
            "invalid knob patch: `max_version_lag`: invalid value: integer `-1`",
        ),
        row(
            patch("{\"weight_update_mode\": \"sometimes\"}"),
            Http(400, "invalid_json"),
            "`weight_update_mode`: unknown variant `sometimes`",
        ),
        row(
            patch("{\"max_concurrent_rollouts\": 2000000}"),
            Http(400, "invalid_knob"),
            "max_concurrent_rollouts: expected an integer ≤ 1048576, got 2000000",
        ),
        row(
            patch("{\"tail_batch_trigger_size\": 4294967295}"),
            Http(400, "invalid_knob"),
            "tail_batch_trigger_size: expected an integer ≤ 1000000000, got 4294967295",
        ),
        row(
            patch("{\"paused\": false, \"staleness_threshold\": -0.5}"),
            Http(400, "invalid_knob"),
            "staleness_threshold: expected a finite number ≥ 0, got -0.5",
        ),
        row(
            patch("{\"domain_mix\": {\"code\": 1.0}}"),
            Http(400, "invalid_knob"),
            "domain_mix.code: unknown domain; the sampler serves: sim",
        ),
        row(
            patch("{\"max_version_lag\": 2000000}"),
            Http(400, "invalid_knob"),
            "max_version_lag: expected an integer ≤ 1000000, got 2000000",
        ),
        row(
            patch("{\"domain_mix\": {\"sim\": 0.0}}"),
            Http(400, "invalid_knob"),
            "domain_mix: expected at least one weight > 0",
        ),
        row(
            Input::Admin(Admin {
                method: "PATCH",
                path: "/v1/knobs",
                body: Body::Text("{\"paused\": false}"),
                token: None,
                content_type: Some("application/json"),
            }),
            Http(401, "unauthorized"),
            "missing bearer token",
        ),
        row(
            Input::Admin(Admin {
                method: "PATCH",
                path: "/v1/knobs",
                body: Body::Text("{\"paused\": false}"),
                token: Some("guess"),
                content_type: Some("application/json"),
            }),
            Http(401, "unauthorized"),
            "wrong bearer token",
        ),
        // Membership and weights are a head's: a single node says so instead of a bare 404.
        row(
            Input::Admin(Admin {
                method: "POST",
                path: "/v1/nodes",
                body: Body::Text(
                    "{\"name\": \"e1\", \"role\": \"engine\", \"url\": \"http://127.0.0.1:1\"}",
                ),
                token: Some(TOKEN),
                content_type: Some("application/json"),
            }),
            Http(404, "not_a_head"),
            "this node is not a head",
        ),
        row(
            Input::Admin(Admin {
                method: "GET",
                path: "/v1/weights/0",
                body: Body::Text(""),
                token: Some(TOKEN),
                content_type: None,
            }),
            Http(404, "not_a_head"),
            "serves no weights",
        ),
        row(
            Input::Admin(Admin {
                method: "POST",
                path: "/v1/resume",
                body: Body::Text(""),
                token: Some("guess"),
                content_type: None,
            }),
            Http(401, "unauthorized"),
            "wrong bearer token",
        ),
        row(
            Input::Admin(Admin {
                method: "PATCH",
                path: "/v1/knobs",
                body: Body::Huge(200_000),
                token: Some(TOKEN),
                content_type: Some("application/json"),
            }),
            Http(413, "payload_too_large"),
            "request body over 65536 bytes",
        ),
        row(
            Input::Admin(Admin {
                method: "PATCH",
                path: "/v1/knobs",
                body: Body::Text("paused=false"),
                token: Some(TOKEN),
                content_type: Some("application/x-www-form-urlencoded"),
            }),
            Http(415, "unsupported_media_type"),
            "expected Content-Type: application/json, got `application/x-www-form-urlencoded`",
        ),
        row(
            Input::Admin(Admin {
                method: "PATCH",
                path: "/v1/knobs",
                body: Body::Text("{\"paused\": false}"),
                token: Some(TOKEN),
                content_type: None,
            }),
            Http(415, "unsupported_media_type"),
            "got `none`",
        ),
        row(
            Input::Admin(Admin {
                method: "POST",
                path: "/v1/resume",
                body: Body::Text("{\"now\": true}"),
                token: Some(TOKEN),
                content_type: Some("application/json"),
            }),
            Http(400, "invalid_body"),
            "POST /v1/resume takes no body",
        ),
        row(
            Input::Admin(Admin {
                method: "GET",
                path: "/v1/knobz",
                body: Body::Text(""),
                token: None,
                content_type: None,
            }),
            Http(404, "not_found"),
            "no route GET /v1/knobz",
        ),
        row(
            Input::Admin(Admin {
                method: "DELETE",
                path: "/v1/knobs",
                body: Body::Text(""),
                token: Some(TOKEN),
                content_type: None,
            }),
            Http(405, "method_not_allowed"),
            "DELETE is not allowed on /v1/knobs",
        ),
        // Clearing the replay store.
        row(
            clear("{\"force\": yes}"),
            Http(400, "invalid_json"),
            "invalid clear request: ",
        ),
        row(
            clear("{\"forced\": true}"),
            Http(400, "invalid_json"),
            "unknown field `forced`, expected `force` or `buckets`",
        ),
        row(
            clear("{\"buckets\": [\"consumed\"]}"),
            Http(400, "invalid_bucket"),
            "bucket `consumed` cannot be cleared: expected one of completed, aborted, expired",
        ),
        row(
            Input::Admin(Admin {
                method: "POST",
                path: "/v1/replay/clear",
                body: Body::Text(""),
                token: None,
                content_type: None,
            }),
            Http(401, "unauthorized"),
            "missing bearer token",
        ),
        row(
            Cli(&[
                "replay",
                "clear",
                "--url",
                "{url}",
                "--token",
                TOKEN,
                "--bucket",
                "in_flight",
            ]),
            Exit(1),
            "admin API answered 400: bucket `in_flight` cannot be cleared",
        ),
        row(
            Cli(&["replay", "clear", "--store", "no-such-dir"]),
            Exit(1),
            "no-such-dir/replay.redb: no replay store here",
        ),
    ]
}
