{{/* Names and labels. */}}
{{- define "pd-cluster.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pd-cluster.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains (include "pd-cluster.name" .) .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "pd-cluster.name" .) | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pd-cluster.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pd-cluster.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pd-cluster.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pd-cluster.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pd-cluster.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Engine roles rendered: prefill only outside colocated mode. */}}
{{- define "pd-cluster.roles" -}}
{{- if eq .Values.mode "colocated" }}["decode"]{{ else }}["prefill", "decode"]{{ end -}}
{{- end -}}

{{/* Pods of a worker group: ceil(replicas / replicasPerPod). Call with the group's values. */}}
{{- define "pd-cluster.pods" -}}
{{- $per := int .replicasPerPod -}}
{{- div (add (int .replicas) (sub $per 1)) $per -}}
{{- end -}}

{{/* Ray actor options of one engine replica. The 0.01 share of the role's custom resource
     equals router.app_config.ROLE_RESOURCE_SHARE: it pins the replica to its worker group,
     GPUs limit packing. */}}
{{- define "pd-cluster.replicaResources" -}}
{{- $group := index .root.Values .role -}}
{{- toYaml (dict "num_gpus" (int $group.gpusPerReplica) "num_cpus" (float64 $group.cpusPerReplica) "resources" (dict .role 0.01)) -}}
{{- end -}}

{{/* A mapping of values with its keys in snake_case: the matching mapping of the args. */}}
{{- define "pd-cluster.snakeKeys" -}}
{{- $out := dict -}}
{{- range $key, $value := . }}{{ $_ := set $out (snakecase $key) $value }}{{ end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The application's args, AppConfig (router/app_config.py): each is the value of the same
     path in snake_case, but num_prefill / num_decode and the replicas' resources (from the
     prefill / decode groups), api_key_env (from apiKey), tenants (each tenant's keys too) and router_replicas /
     router_autoscaling (from router). */}}
{{- define "pd-cluster.appArgs" -}}
{{- $v := .Values -}}
{{- $args := dict
      "num_decode" (int $v.decode.replicas)
      "decode_resources" (include "pd-cluster.replicaResources" (dict "root" . "role" "decode") | fromYaml) -}}
{{- range $key := list "mode" "transport" "conditionalDisaggThreshold" "prefillFailurePolicy" -}}
{{- if hasKey $v $key }}{{ $_ := set $args (snakecase $key) (index $v $key) }}{{ end -}}
{{- end -}}
{{- range $key := list "engine" "limits" "routing" "planner" "kvPool" "kvTiers" -}}
{{- $_ := set $args (snakecase $key) (include "pd-cluster.snakeKeys" (index $v $key) | fromYaml) -}}
{{- end -}}
{{- if $v.engine.speculative -}}
{{- $_ := set $args.engine "speculative" (include "pd-cluster.snakeKeys" $v.engine.speculative | fromYaml) -}}
{{- end -}}
{{- $_ := set $args "tracing" (include "pd-cluster.snakeKeys" $v.tracing | fromYaml) -}}
{{- if ne $v.mode "colocated" -}}
{{- $_ := set $args "num_prefill" (int $v.prefill.replicas) -}}
{{- $_ := set $args "prefill_resources" (include "pd-cluster.replicaResources" (dict "root" . "role" "prefill") | fromYaml) -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $group := index $v $role -}}
{{- $tp := int ($v.engine.tensorParallelSize | default 1) -}}
{{- $what := "engine.tensorParallelSize" -}}
{{- $_ := set $args (printf "%s_tensor_parallel_size" $role) $group.tensorParallelSize -}}
{{- if $group.tensorParallelSize -}}
{{- $tp = int $group.tensorParallelSize -}}
{{- $what = printf "%s.tensorParallelSize" $role -}}
{{- end -}}
{{- $gpus := int $group.gpusPerReplica -}}
{{- if and (gt $tp 1) (gt $gpus 0) (lt $gpus $tp) (or (eq $role "decode") (ne $v.mode "colocated")) -}}
{{- fail (printf "%s.gpusPerReplica (%d) is below %s (%d): each rank needs a GPU" $role $gpus $what $tp) -}}
{{- end -}}
{{- /* AppConfig's kv_tiers rules, checked here so that `helm install` fails, not the app. */ -}}
{{- if and $v.kvTiers.enabled (gt $tp 1) (or (eq $role "decode") (ne $v.mode "colocated")) -}}
{{- fail (printf "kvTiers.enabled: not supported with %s %d yet (an engine's KV cache must be one shard)" $what $tp) -}}
{{- end -}}
{{- end -}}
{{- if and $v.kvTiers.enabled (not $v.engine.enablePrefixCaching) -}}
{{- fail "kvTiers.enabled: needs engine.enablePrefixCaching (the tiers keep blocks by prefix hash)" -}}
{{- end -}}
{{- if $v.engine.maxModelLen -}}
{{- range $key := list "maxTokens" "maxPromptTokens" -}}
{{- $limit := index $v.limits $key -}}
{{- if and $limit (gt (int $limit) (int $v.engine.maxModelLen)) -}}
{{- fail (printf "limits.%s (%d) exceeds engine.maxModelLen (%d)" $key (int $limit) (int $v.engine.maxModelLen)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $v.apiKey.secretName -}}
{{- $_ := set $args "api_key_env" $v.apiKey.envName -}}
{{- end -}}
{{- if and $v.tenants $v.apiKey.secretName -}}
{{- fail "tenants: set apiKey.secretName or tenants, not both (a tenant has its own key)" -}}
{{- end -}}
{{- $tenants := list -}}
{{- range $t := $v.tenants -}}
{{- $tenants = append $tenants (include "pd-cluster.snakeKeys" $t | fromYaml) -}}
{{- end -}}
{{- $_ := set $args "tenants" $tenants -}}
{{- $_ := set $args "router_autoscaling" (include "pd-cluster.routerAutoscaling" . | fromYaml | default nil) -}}
{{- if not $args.router_autoscaling -}}
{{- $_ := set $args "router_replicas" (int $v.router.replicas) -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* The P:D planner's reach, JSON: per role, the fewest and the most replicas it may run,
     {"prefill": {"least": n, "most": n}, "decode": {...}} (AppConfig.most_replicas: max_<role>,
     and no more than the GPU budget leaves once the other role is at its minimum); {} when
     the planner is off. AppConfig checks the same rules when the application starts; they
     are checked here too so that `helm install` fails, not the deployment. */}}
{{- define "pd-cluster.plannerReach" -}}
{{- $v := .Values -}}
{{- $p := $v.planner -}}
{{- if not $p.enabled -}}
{}
{{- else -}}
{{- if eq $v.mode "colocated" -}}
{{- fail "planner.enabled needs mode disaggregated or pooled (colocated has no prefill tier to resize)" -}}
{{- end -}}
{{- $tps := dict -}}
{{- $whats := dict -}}
{{- range $role := list "prefill" "decode" -}}
{{- $group := index $v $role -}}
{{- $_ := set $tps $role (int ($v.engine.tensorParallelSize | default 1)) -}}
{{- $_ := set $whats $role "engine.tensorParallelSize" -}}
{{- if $group.tensorParallelSize -}}
{{- $_ := set $tps $role (int $group.tensorParallelSize) -}}
{{- $_ := set $whats $role (printf "%s.tensorParallelSize" $role) -}}
{{- end -}}
{{- end -}}
{{- if ne $tps.prefill $tps.decode -}}
{{- fail (printf "planner.enabled needs one tensor-parallel size for both roles (a flip keeps the engine's weights, sharded one way): %s is %d, %s %d" $whats.prefill $tps.prefill $whats.decode $tps.decode) -}}
{{- end -}}
{{- $tp := $tps.decode -}}
{{- $keys := dict "prefill" "Prefill" "decode" "Decode" -}}
{{- $start := 0 -}}
{{- range $role := list "prefill" "decode" -}}
{{- $least := int (index $p (printf "min%s" (index $keys $role))) -}}
{{- $most := int (index $p (printf "max%s" (index $keys $role))) -}}
{{- $count := int (index $v $role).replicas -}}
{{- if lt $most $least -}}
{{- fail (printf "planner.max%s (%d) is below planner.min%s (%d)" (index $keys $role) $most (index $keys $role) $least) -}}
{{- end -}}
{{- if or (lt $count $least) (gt $count $most) -}}
{{- fail (printf "%s.replicas (%d) is outside planner.min%s..max%s (%d..%d)" $role $count (index $keys $role) (index $keys $role) $least $most) -}}
{{- end -}}
{{- $start = add $start (mul $count $tp) -}}
{{- end -}}
{{- $budget := $start -}}
{{- if not (kindIs "invalid" $p.gpuBudget) -}}
{{- $budget = int $p.gpuBudget -}}
{{- if lt $budget $start -}}
{{- fail (printf "planner.gpuBudget (%d) is below the %d GPUs the tiers start with (prefill.replicas %d + decode.replicas %d, x tensor-parallel size %d)" $budget $start (int $v.prefill.replicas) (int $v.decode.replicas) $tp) -}}
{{- end -}}
{{- end -}}
{{- $replicas := div $budget $tp -}}
{{- $reach := dict -}}
{{- range $role := list "prefill" "decode" -}}
{{- $other := ternary "Decode" "Prefill" (eq $role "prefill") -}}
{{- $most := min (int (index $p (printf "max%s" (index $keys $role)))) (sub $replicas (int (index $p (printf "min%s" $other)))) -}}
{{- $_ := set $reach $role (dict "least" (int (index $p (printf "min%s" (index $keys $role)))) "most" $most) -}}
{{- end -}}
{{- toJson $reach -}}
{{- end -}}
{{- end -}}

{{/* The args' router_autoscaling (empty when router.autoscaling is off): the values in
     snake_case without `enabled`. AppConfig checks the same rules when the application
     starts; they are checked here too so that `helm install` fails, not the deployment. */}}
{{- define "pd-cluster.routerAutoscaling" -}}
{{- $router := .Values.router -}}
{{- $scaling := $router.autoscaling -}}
{{- if $scaling.enabled -}}
{{- if ne (int $router.replicas) 1 -}}
{{- fail (printf "router.replicas (%d) with router.autoscaling.enabled: leave router.replicas at 1, Serve then keeps the router between router.autoscaling.minReplicas and maxReplicas" (int $router.replicas)) -}}
{{- end -}}
{{- $least := int (default 1 $scaling.minReplicas) -}}
{{- if not (hasKey $scaling "maxReplicas") -}}
{{- fail "router.autoscaling.maxReplicas is required with router.autoscaling.enabled" -}}
{{- end -}}
{{- $most := int $scaling.maxReplicas -}}
{{- if lt $most $least -}}
{{- fail (printf "router.autoscaling.maxReplicas (%d) is below minReplicas (%d)" $most $least) -}}
{{- end -}}
{{- $initial := $scaling.initialReplicas -}}
{{- if and (not (kindIs "invalid" $initial)) (or (lt (int $initial) $least) (gt (int $initial) $most)) -}}
{{- fail (printf "router.autoscaling.initialReplicas (%d) is outside minReplicas..maxReplicas (%d..%d)" (int $initial) $least $most) -}}
{{- end -}}
{{- include "pd-cluster.snakeKeys" (omit $scaling "enabled") -}}
{{- end -}}
{{- end -}}

{{/* The Serve config file (same shape as configs/pd.yaml). */}}
{{- define "pd-cluster.serveConfig" -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: {{ int .Values.service.port }}
applications:
  - name: pd
    route_prefix: /
    import_path: router.app:build_app
    args:
      {{- include "pd-cluster.appArgs" . | nindent 6 }}
{{- end -}}

{{/* UCX_TLS: RDMA verbs when RDMA is on, CUDA copies when engines use GPUs; tcp always
     stays in the list (UCX's wire-up and the fallback between hosts). */}}
{{- define "pd-cluster.ucxTls" -}}
{{- if .Values.ucx.tls -}}
{{- .Values.ucx.tls -}}
{{- else -}}
{{- $tls := list -}}
{{- if .Values.rdma.enabled }}{{ $tls = append $tls "rc" }}{{ end -}}
{{- if gt (add (int .Values.prefill.gpusPerReplica) (int .Values.decode.gpusPerReplica)) 0 -}}
{{- $tls = concat $tls (list "cuda_copy" "cuda_ipc") -}}
{{- end -}}
{{- join "," (concat $tls (list "sm" "self" "tcp")) -}}
{{- end -}}
{{- end -}}

{{/* Env of every Ray container. Ray reads RAY_SERVE_* when it starts: HAProxy ingress. */}}
{{- define "pd-cluster.env" -}}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: {{ ternary "1" "0" .Values.service.haproxy | quote }}
{{- if .Values.service.haproxy }}
{{- /* A request HAProxy sent to a router replica that died before answering goes to
    another (router/app.py HAPROXY_RETRY_ENV). */}}
- name: RAY_SERVE_HAPROXY_RETRY_ON
  value: "conn-failure empty-response"
{{- end }}
- name: UCX_TLS
  value: {{ include "pd-cluster.ucxTls" . | quote }}
{{- with .Values.ucx.netDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- range $name, $value := .Values.ucx.env }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
- name: XDG_CACHE_HOME
  value: /home/ray/.cache
- name: TRITON_CACHE_DIR
  value: /home/ray/.cache/triton
{{- if .Values.apiKey.secretName }}
- name: {{ .Values.apiKey.envName }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.secretName }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Container security context; RDMA adds back only IPC_LOCK (memory registration pins). */}}
{{- define "pd-cluster.containerSecurityContext" -}}
{{- $ctx := deepCopy .root.Values.containerSecurityContext -}}
{{- if and .engine .root.Values.rdma.enabled -}}
{{- $caps := default dict $ctx.capabilities -}}
{{- $_ := set $caps "add" (list "IPC_LOCK") -}}
{{- $_ := set $ctx "capabilities" $caps -}}
{{- end -}}
{{- toYaml $ctx -}}
{{- end -}}

{{/* Pod template of a Ray node. Args: root, name (container), group (its values), engine (bool:
     a prefill/decode pod, which gets GPUs, RDMA and /dev/shm), role. */}}
{{- define "pd-cluster.podTemplate" -}}
{{- $root := .root -}}
{{- $group := .group -}}
metadata:
  labels:
    {{- include "pd-cluster.selectorLabels" $root | nindent 4 }}
    pd-cluster/role: {{ .role }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .name }}
      image: {{ include "pd-cluster.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      securityContext:
        {{- include "pd-cluster.containerSecurityContext" (dict "root" $root "engine" .engine) | nindent 8 }}
      env:
        {{- include "pd-cluster.env" $root | nindent 8 }}
      ports:
        - {containerPort: 8000, name: serve}
        - {containerPort: 8080, name: metrics}
        {{- if not .engine }}
        - {containerPort: 6379, name: gcs}
        - {containerPort: 8265, name: dashboard}
        - {containerPort: 10001, name: client}
        {{- end }}
      resources:
        {{- $res := deepCopy (default dict $group.resources) -}}
        {{- if .engine -}}
        {{- $gpus := mul (int $group.gpusPerReplica) (int $group.replicasPerPod) -}}
        {{- $extra := dict -}}
        {{- if gt $gpus 0 }}{{ $_ := set $extra "nvidia.com/gpu" $gpus }}{{ end -}}
        {{- if $root.Values.rdma.enabled }}{{ $_ := set $extra $root.Values.rdma.resourceName (int $root.Values.rdma.count) }}{{ end -}}
        {{- range $kind := list "requests" "limits" -}}
        {{- $_ := set $res $kind (merge (default dict (index $res $kind)) $extra) -}}
        {{- $memory := index (index $res $kind) "memory" -}}
        {{- if and $root.Values.kvTiers.enabled (not (kindIs "invalid" $memory)) -}}
        {{- $_ := set (index $res $kind) "memory" (include "pd-cluster.plusHostTier" (dict "root" $root "quantity" $memory)) -}}
        {{- end -}}
        {{- end -}}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      volumeMounts:
        - {name: tmp, mountPath: /tmp}
        - {name: cache, mountPath: /home/ray/.cache}
        {{- if .engine }}
        - {name: dshm, mountPath: /dev/shm}
        {{- end }}
  volumes:
    - {name: tmp, emptyDir: {}}
    - {name: cache, emptyDir: {}}
    {{- if .engine }}
    - name: dshm
      emptyDir: {medium: Memory, sizeLimit: {{ ternary (include "pd-cluster.plusHostTier" (dict "root" $root "quantity" $group.shmSize)) $group.shmSize (and $root.Values.kvTiers.enabled true) }}}
    {{- end }}
{{- end -}}

{{/* Bytes of a Kubernetes quantity ("64Gi", "500M", "1.5Gi", 68719476736), an integer. */}}
{{- define "pd-cluster.bytes" -}}
{{- if kindIs "string" . -}}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" . -}}
{{- $unit := trimPrefix $number . -}}
{{- $units := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- if or (not $number) (not (hasKey $units $unit)) -}}
{{- fail (printf "cannot read %q as a memory size (e.g. 64Gi, 500M, 1073741824)" .) -}}
{{- end -}}
{{- mulf $number (index $units $unit) | ceil | int64 -}}
{{- else -}}
{{- int64 . -}}
{{- end -}}
{{- end -}}

{{/* A memory quantity of an engine pod plus the host tier of kvTiers (one per Ray node, so
     one per pod, in /dev/shm, which counts as the pod's memory), in Mi rounded up. Args:
     root, quantity. */}}
{{- define "pd-cluster.plusHostTier" -}}
{{- $bytes := add (include "pd-cluster.bytes" .quantity | int64) (int64 .root.Values.kvTiers.hostBytes) -}}
{{- printf "%dMi" (div (add $bytes 1048575) 1048576) -}}
{{- end -}}

{{/* KubeRay's rayStartParams value for custom resources: a shell-quoted JSON object. */}}
{{- define "pd-cluster.rayResources" -}}
{{- toJson (dict .role (int .group.replicasPerPod)) | quote | squote -}}
{{- end -}}
