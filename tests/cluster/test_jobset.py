"""configs/cluster/jobset.yaml against the schemas a cluster would hold it to (issue 61, item 5).

No cluster applies it here; standard validators do what the API server's schema check would:

* The JobSet against the JobSet CRD's `openAPIV3Schema` (kubernetes-sigs/jobset v0.12.0,
  config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml), with `jsonschema`. The CRD is not
  in this repository (another project's file): the test reads it from $MEGASCALE_JOBSET_CRD or
  ../shared/jobset.x-k8s.io_jobsets.yaml beside the checkout, and skips without it.
* The ServiceAccount, ClusterRole and ClusterRoleBinding, and the batch/v1 Job the JobSet stamps
  out of its replicatedJob (Job spec, pod template, containers, env, volumes, affinity), against
  Kubernetes' own OpenAPI schemas as `kubernetes-validate` ships them (strict: unknown fields are
  errors, as `kubectl apply`'s default server-side field validation makes them). Needs no file.
* The JobSet webhook's name rule: the longest pod name it will make is a DNS-1035 label.
"""

import copy
import os
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBSET_YAML = os.path.join(REPO, "configs", "cluster", "jobset.yaml")
# The Kubernetes minor the CRD was generated against (jobset v0.12.0's go.mod: k8s.io/api v0.36.0).
KUBERNETES = "1.36"


def documents() -> list[dict]:
    with open(JOBSET_YAML) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def jobset() -> dict:
    return next(d for d in documents() if d["kind"] == "JobSet")


def crd_path() -> str | None:
    for path in (os.environ.get("MEGASCALE_JOBSET_CRD"),
                 os.path.join(os.path.dirname(REPO), "shared", "jobset.x-k8s.io_jobsets.yaml")):
        if path and os.path.exists(path):
            return path
    return None


def strict(node):
    """The CRD's OpenAPI v3 schema as JSON Schema that refuses what the API server refuses.

    * Unknown fields: an object schema with `properties` and no `additionalProperties` gets
      `additionalProperties: false` (the server's strict field validation; it would prune them
      otherwise), unless it says `x-kubernetes-preserve-unknown-fields`.
    * `x-kubernetes-int-or-string`: controller-gen writes `anyOf: [integer, string]` beside it;
      where it did not, the anyOf is added.
    * `nullable: true`: null is allowed too.
    * `x-kubernetes-list-type: set` becomes `uniqueItems`; `map` with `x-kubernetes-list-map-keys`
      is checked by the `x-kubernetes-list-map-keys` keyword of `validator()` (no two items with
      the same keys: two containers or two env entries of one name).
    * Not evaluated: `x-kubernetes-validations` (CEL; test_the_cel_rules_pass does them by hand),
      `format` (int32/int64/date-time), `x-kubernetes-map-type` (merge strategy only)."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if out.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


def list_map_keys(validator, keys, instance, schema):
    if schema.get("x-kubernetes-list-type") != "map" or not isinstance(instance, list):
        return
    seen = set()
    for item in instance:
        if isinstance(item, dict):
            key = tuple(repr(item.get(k)) for k in keys)
            if key in seen:
                yield jsonschema.ValidationError(f"duplicate entries for key {dict(zip(keys, key))}")
            seen.add(key)


def validator(crd: dict, version: str):
    """A Draft 4 validator (OpenAPI 3.0's schema dialect) for `version` of the CRD."""
    served = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    assert served, f"the CRD serves no version {version}"
    cls = jsonschema.validators.extend(jsonschema.Draft4Validator, {"x-kubernetes-list-map-keys": list_map_keys})
    schema = strict(served[0]["schema"]["openAPIV3Schema"])
    cls.check_schema(schema)
    return cls(schema)


@pytest.fixture(scope="module")
def crd() -> dict:
    path = crd_path()
    if path is None:
        pytest.skip("no JobSet CRD: set MEGASCALE_JOBSET_CRD to kubernetes-sigs/jobset v0.12.0's "
                    "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml")
    with open(path) as f:
        return next(d for d in yaml.safe_load_all(f) if d)


def errors(crd: dict, doc: dict) -> list[str]:
    group, version = doc["apiVersion"].split("/")
    assert (group, doc["kind"]) == (crd["spec"]["group"], crd["spec"]["names"]["kind"])
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator(crd, version).iter_errors(doc))


def test_the_jobset_is_valid_against_the_crd(crd):
    assert errors(crd, jobset()) == []


def replicated_job(doc):
    return doc["spec"]["replicatedJobs"][0]


def pod_spec(doc):
    return replicated_job(doc)["template"]["spec"]["template"]["spec"]


def _typo(d):
    replicated_job(d)["replica"] = 1


def _string_count(d):
    d["spec"]["failurePolicy"]["maxRestarts"] = "3"


def _env_typo(d):
    pod_spec(d)["containers"][0]["env"][0] = {"name": "REDIS_URL", "valueFrm": {}}


def _duplicate_env(d):
    pod_spec(d)["containers"][0]["env"].append({"name": "RUN_DIR", "value": "/elsewhere"})


def _command_as_a_string(d):
    pod_spec(d)["containers"][0]["command"] = "bash configs/cluster/jobset_worker.sh"


def _no_containers_name(d):
    del pod_spec(d)["containers"][0]["name"]


@pytest.mark.parametrize("mutate, where", [
    (_typo, "spec.replicatedJobs.0: Additional properties are not allowed ('replica' was unexpected)"),
    (_string_count, "spec.failurePolicy.maxRestarts: '3' is not of type 'integer'"),
    (_env_typo, "Additional properties are not allowed ('valueFrm' was unexpected)"),
    (_duplicate_env, "duplicate entries for key {'name': \"'RUN_DIR'\"}"),
    (_command_as_a_string, "containers.0.command: 'bash configs/cluster/jobset_worker.sh' is not of type 'array'"),
    (_no_containers_name, "'name' is a required property"),
])
def test_the_crd_refuses_a_broken_jobset(crd, mutate, where):
    doc = copy.deepcopy(jobset())
    mutate(doc)
    found = errors(crd, doc)
    assert any(where in e for e in found), found


def test_quantities_are_ints_or_strings(crd):
    """x-kubernetes-int-or-string: `nvidia.com/gpu: 8` and `"8"` are both a quantity; a list is not."""
    doc = copy.deepcopy(jobset())
    limits = pod_spec(doc)["containers"][0]["resources"]["limits"]
    limits["nvidia.com/gpu"] = "8"
    assert errors(crd, doc) == []
    limits["nvidia.com/gpu"] = [8]
    assert errors(crd, doc), "a list passed as a quantity"


def cel_rules(node, path=()):
    """(path of property names, rule) for every CEL rule of a schema."""
    if isinstance(node, dict):
        for rule in node.get("x-kubernetes-validations", []):
            yield path, rule["rule"]
        for k, v in node.get("properties", {}).items():
            yield from cel_rules(v, (*path, k))
        if "items" in node:
            yield from cel_rules(node["items"], path)


def values_at(doc, path):
    """What a rule at `path` runs on: the values there (each item of a list), none if absent."""
    values = [doc]
    for name in path:
        values = [v[name] for v in values if isinstance(v, dict) and name in v]
        values = [x for v in values for x in (v if isinstance(v, list) else [v])]
    return values


# The CRD's rules that run on a create (no `oldSelf`), by hand: a rule runs only where its field is.
CREATE_RULES = {
    "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' && "
    "self.replicatedJobs.exists(x, has(x.dependsOn)))":
        lambda spec: not (spec.get("startupPolicy", {}).get("startupPolicyOrder") == "InOrder"
                          and any("dependsOn" in r for r in spec["replicatedJobs"])),
    "self.templates.all(t, !has(t.metadata.namespace) || size(t.metadata.namespace) == 0)":
        lambda policy: all(not t.get("metadata", {}).get("namespace") for t in policy["templates"]),
}


def test_the_cel_rules_pass(crd):
    """`jsonschema` cannot run the CRD's CEL rules (x-kubernetes-validations): those that compare
    with the old object (`oldSelf`) run on updates only; the others are evaluated here by hand, and
    a rule not known here fails the test where jobset.yaml has the field it runs on."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    doc = jobset()
    for path, rule in cel_rules(schema):
        if "oldSelf" in rule:
            continue
        for value in values_at(doc, path):
            assert rule in CREATE_RULES, f"a CEL rule at {'.'.join(path)} not evaluated here: {rule}"
            assert CREATE_RULES[rule](value), f"{'.'.join(path)} breaks {rule}"


def as_job(doc: dict) -> dict:
    """The batch/v1 Job the JobSet controller makes of the replicatedJob (its spec, copied)."""
    rjob = replicated_job(doc)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{doc['metadata']['name']}-{rjob['name']}-0"},
            "spec": rjob["template"]["spec"]}


def test_the_other_objects_and_the_jobs_pods_are_valid_kubernetes():
    """Kubernetes' own schemas (strict) for the RBAC objects and for the Job the set stamps out."""
    docs = documents()
    assert sorted(d["kind"] for d in docs) == ["ClusterRole", "ClusterRoleBinding", "JobSet", "ServiceAccount"]
    for doc in [d for d in docs if d["kind"] != "JobSet"] + [as_job(jobset())]:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_kubernetes_validate_refuses_a_broken_pod():
    doc = as_job(jobset())
    doc["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrm"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="valueFrm"):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    role = next(d for d in documents() if d["kind"] == "ClusterRole")
    role["rules"][0]["verbs"] = "patch"
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'array'"):
        kubernetes_validate.validate(role, KUBERNETES, strict=True)


DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def test_the_pod_names_the_webhook_would_make_are_dns_labels():
    """JobSet's admission webhook (v0.12.0, pkg/webhooks/jobset_webhook.go) refuses a set whose
    longest pod name, <jobset>-<replicatedJob>-<last job>-<last pod>-abcde, is no DNS-1035 label."""
    doc = jobset()
    rjob = replicated_job(doc)
    name = f"{doc['metadata']['name']}-{rjob['name']}-{rjob['replicas'] - 1}-{rjob['template']['spec']['completions'] - 1}-abcde"
    assert len(name) <= 63 and DNS_1035.fullmatch(name), name
