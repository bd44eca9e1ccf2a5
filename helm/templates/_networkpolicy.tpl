{{/* The job's NetworkPolicy: what it admits and lets out (values.yaml `networkPolicy`,
docs/security.md), and the values it refuses at render, each in one line naming the value. */}}

{{/* The storage endpoint of checkpoint.s3.endpoint as JSON {"host", "port", "ip"} ("ip" when
the host is an IPv4 address, which the policy can name); {} without an endpoint. */}}
{{- define "ddp.storageEndpoint" -}}
{{- $s3 := (include "ddp.checkpointValues" . | fromJson).s3 -}}
{{- if $s3.endpoint -}}
{{- $url := urlParse $s3.endpoint -}}
{{- $host := regexReplaceAll ":[0-9]+$" $url.host "" -}}
{{- $port := regexFind "[0-9]+$" (regexFind ":[0-9]+$" $url.host) -}}
{{- if not $port }}{{ $port = ternary "80" "443" (eq $url.scheme "http") }}{{ end -}}
{{- $ip := ternary $host "" (regexMatch "^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$" $host) -}}
{{- dict "host" $host "port" (atoi $port) "ip" $ip | toJson -}}
{{- else -}}
{{- dict | toJson -}}
{{- end -}}
{{- end -}}

{{/* An IPv4 address as one integer. */}}
{{- define "ddp.ipv4Number" -}}
{{- $octets := splitList "." . -}}
{{- add (mul (atoi (index $octets 0)) 16777216) (mul (atoi (index $octets 1)) 65536) (mul (atoi (index $octets 2)) 256) (atoi (index $octets 3)) -}}
{{- end -}}

{{/* "yes" when IPv4 block .cidr holds address .ip; nothing otherwise (an IPv6 block, too). */}}
{{- define "ddp.blockHolds" -}}
{{- $parts := splitList "/" .cidr -}}
{{- if and (eq (len $parts) 2) (regexMatch "^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$" (index $parts 0)) -}}
{{- $size := 1 -}}
{{- range until (sub 32 (atoi (index $parts 1)) | int) }}{{ $size = mul $size 2 }}{{ end -}}
{{- if eq (div (include "ddp.ipv4Number" (index $parts 0) | atoi) $size) (div (include "ddp.ipv4Number" .ip | atoi) $size) }}yes{{ end -}}
{{- end -}}
{{- end -}}

{{/* A label selector that can match no pod: a value no label can have, `In` with no value,
or an expression that contradicts matchLabels. Its reason, or nothing. */}}
{{- define "ddp.selectsNoPod" -}}
{{- $labels := default dict .matchLabels -}}
{{- range $key, $value := $labels -}}
{{- if not (regexMatch "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$" (toString $value)) -}}
{{- printf "%s=%v is no label value (63 letters, digits, -, _ or . at most), so it matches no pod" $key $value -}}
{{- end -}}
{{- end -}}
{{- range .matchExpressions -}}
{{- $values := default list .values -}}
{{- if and (eq .operator "In") (empty $values) -}}
{{- printf "%s In []: no value to match, so it matches no pod" .key -}}
{{- else if hasKey $labels .key -}}
{{- $wanted := toString (get $labels .key) -}}
{{- if or (eq .operator "DoesNotExist") (and (eq .operator "In") (not (has $wanted $values))) (and (eq .operator "NotIn") (has $wanted $values)) -}}
{{- printf "matchLabels %s=%s and the expression %s %s %v: no pod has both" .key $wanted .key .operator $values -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* One NetworkPolicyPeer given in values (.peer at .where), refused when it names nothing,
selects every pod (of the job's namespace or of the cluster), can select no pod, admits
every address (.from, an ingress source), or lets the pods reach the instance metadata
service (an egress destination). */}}
{{- define "ddp.checkPeer" -}}
{{- $peer := .peer -}}
{{- if not (or (hasKey $peer "podSelector") (hasKey $peer "namespaceSelector") (hasKey $peer "ipBlock")) -}}
{{- fail (printf "%s=%s: a peer names pods (podSelector, with namespaceSelector for another namespace) or addresses (ipBlock)" .where (toJson $peer)) -}}
{{- end -}}
{{- if or (hasKey $peer "podSelector") (hasKey $peer "namespaceSelector") -}}
{{- $pods := default dict $peer.podSelector -}}
{{- if not (or $pods.matchLabels $pods.matchExpressions) -}}
{{- $scope := ternary "every pod in the job's namespace" "every pod of the namespaces it selects" (empty $peer.namespaceSelector) -}}
{{- fail (printf "%s=%s: selects %s; name the pods' labels in podSelector" .where (toJson $peer) $scope) -}}
{{- end -}}
{{- range $field := list "podSelector" "namespaceSelector" -}}
{{- with (include "ddp.selectsNoPod" (default dict (get $peer $field))) -}}
{{- fail (printf "%s.%s: %s" $.where $field .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- with $peer.ipBlock -}}
{{- if and $.from (regexMatch "/0$" .cidr) -}}
{{- fail (printf "%s.ipBlock.cidr=%s: admits every address to the job's pods, whose rendezvous store runs what it is sent; name the addresses that need in" $.where .cidr) -}}
{{- end -}}
{{- if and (not $.from) (include "ddp.blockHolds" (dict "cidr" .cidr "ip" "169.254.169.254")) -}}
{{- $excepted := false -}}
{{- range (default list (get . "except")) }}{{ if include "ddp.blockHolds" (dict "cidr" . "ip" "169.254.169.254") }}{{ $excepted = true }}{{ end }}{{ end -}}
{{- if not $excepted -}}
{{- fail (printf "%s.ipBlock.cidr=%s: lets the pods reach the instance metadata service (169.254.169.254) and the node's credentials; except 169.254.169.254/32 from it (for EKS Pod Identity's agent set networkPolicy.podIdentity=true instead)" $.where .cidr) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Every value of `networkPolicy` checked before anything renders. */}}
{{- define "ddp.networkPolicyChecks" -}}
{{- $np := .Values.networkPolicy -}}
{{- if $np.enabled -}}
{{- if .Values.metrics.port -}}
{{- include "ddp.checkPeer" (dict "peer" $np.prometheus "where" "networkPolicy.prometheus" "from" true) -}}
{{- end -}}
{{- range $index, $peer := $np.healthFrom -}}
{{- include "ddp.checkPeer" (dict "peer" $peer "where" (printf "networkPolicy.healthFrom[%d]" $index) "from" true) -}}
{{- end -}}
{{- range $index, $peer := $np.apiServer -}}
{{- include "ddp.checkPeer" (dict "peer" $peer "where" (printf "networkPolicy.apiServer[%d]" $index) "from" true) -}}
{{- end -}}
{{- if and (eq .Values.jobKind "TrainJob") $np.trainerStatusServer -}}
{{- include "ddp.checkPeer" (dict "peer" $np.trainerStatusServer "where" "networkPolicy.trainerStatusServer" "from" false) -}}
{{- end -}}
{{- if empty $np.dns -}}
{{- fail "networkPolicy.dns=[]: the pods could resolve no name, S3's included; name your cluster's DNS pods (default: k8s-app=kube-dns in kube-system)" -}}
{{- end -}}
{{- range $index, $peer := $np.dns -}}
{{- include "ddp.checkPeer" (dict "peer" $peer "where" (printf "networkPolicy.dns[%d]" $index) "from" false) -}}
{{- end -}}
{{- range $index, $peer := $np.storage.to -}}
{{- include "ddp.checkPeer" (dict "peer" $peer "where" (printf "networkPolicy.storage.to[%d]" $index) "from" false) -}}
{{- end -}}
{{- range $index, $rule := $np.extraIngress -}}
{{- if empty $rule.from -}}
{{- fail (printf "networkPolicy.extraIngress[%d]: no `from`, so every pod and address could reach the job's pods, the rendezvous store included; name the peers that need in" $index) -}}
{{- end -}}
{{- range $peerIndex, $peer := $rule.from -}}
{{- include "ddp.checkPeer" (dict "peer" $peer "where" (printf "networkPolicy.extraIngress[%d].from[%d]" $index $peerIndex) "from" true) -}}
{{- end -}}
{{- end -}}
{{- range $index, $rule := $np.extraEgress -}}
{{- if empty $rule.to -}}
{{- fail (printf "networkPolicy.extraEgress[%d]: no `to`, so the pods could reach every address, the instance metadata service included; name the peers they need" $index) -}}
{{- end -}}
{{- range $peerIndex, $peer := $rule.to -}}
{{- include "ddp.checkPeer" (dict "peer" $peer "where" (printf "networkPolicy.extraEgress[%d].to[%d]" $index $peerIndex) "from" false) -}}
{{- end -}}
{{- end -}}
{{- $endpoint := include "ddp.storageEndpoint" . | fromJson -}}
{{- if and $endpoint.host (not $endpoint.ip) -}}
{{- $covered := false -}}
{{- range $np.storage.ports -}}
{{- $from := int (default 0 .port) -}}
{{- if or (not .port) (eq $from (int $endpoint.port)) (and .endPort (le $from (int $endpoint.port)) (ge (int .endPort) (int $endpoint.port))) }}{{ $covered = true }}{{ end -}}
{{- end -}}
{{- if not $covered -}}
{{- $s3 := (include "ddp.checkpointValues" . | fromJson).s3 -}}
{{- fail (printf "checkpoint.s3.endpoint=%s: the NetworkPolicy lets the pods reach storage on networkPolicy.storage.ports only, and port %d is not among them; add it, and the store's pods or addresses to networkPolicy.storage.to (a policy cannot name a host or a Service)" $s3.endpoint (int $endpoint.port)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* This install's trainer pods, as a peer: the same namespace, the same labels. */}}
{{- define "ddp.ownPodsPeer" -}}
- podSelector:
    matchLabels:
      {{- include "ddp.podLabels" . | nindent 6 }}
{{- end -}}

{{/* Egress to S3 when storage.to is empty: every public address (IPv4 and IPv6), that is,
outside the private (RFC 1918, RFC 4193), shared (RFC 6598), link-local and loopback ranges;
the metadata service lives in the link-local one. */}}
{{- define "ddp.publicAddresses" -}}
- ipBlock:
    cidr: 0.0.0.0/0
    except: [10.0.0.0/8, 100.64.0.0/10, 127.0.0.0/8, 169.254.0.0/16, 172.16.0.0/12, 192.168.0.0/16]
- ipBlock:
    cidr: ::/0
    except: ["::1/128", "fc00::/7", "fe80::/10"]
{{- end -}}
