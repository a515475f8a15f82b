--[[
slurm-elastic job_submit plugin (Slurm's job_submit/lua; Debian ships it as job_submit_lua.so).

Install: copy this file as `job_submit.lua` next to slurm.conf and set `JobSubmitPlugins=lua`
(keep any site plugin: `JobSubmitPlugins=lua,...`), then `scontrol reconfigure`.

At submit time, for a job whose --comment starts with "elastic:":
  * the spec is validated with the same rules as slurm_elastic.spec.parse_spec (a malformed spec is
    rejected with a message that sbatch prints, naming the field);
  * --requeue is required (Slurm refuses to requeue a --no-requeue job, even for root);
  * the job is held (priority 0) until the slurm-elastic daemon places it.
On updates (slurm_job_modify also runs for `scontrol update`/`release`):
  * root and SlurmUser (the daemon) pass unchanged;
  * a user may not release or re-prioritise their own held elastic job (that would start it behind
    the daemon's back), and a changed elastic comment is validated again.
Users cannot write AdminComment at all (Slurm refuses it), which is where the daemon's decision lives.
--]]

local PREFIX = "elastic:"
-- The site maximum for batch sizes: 2^24 samples, MAX_BATCH_LIMIT in slurm_elastic/spec.py (which says why).
local MAX_BATCH = 16777216
local INT_LIMITS = {
  min_gpus = 1048576, max_gpus = 1048576, gpus = 1048576, gpus_per_node = 1048576,
  min_batch = MAX_BATCH, max_batch = MAX_BATCH, batch = MAX_BATCH, max_local_batch = MAX_BATCH,
  min_local_batch = MAX_BATCH, max_accum = 4096,
}
-- ckpt_dir may not be (or be under) a system directory: the daemon reads there as root.
-- The same list as SYSTEM_DIRS in slurm_elastic/spec.py ("*": any name starting so).
local SYSTEM_DIRS = { "/etc", "/usr", "/bin", "/sbin", "/lib*", "/boot", "/dev", "/proc", "/sys", "/run", "/root",
                      "/var/lib/slurm*", "/var/spool/slurm*", "/var/run", "/var/log", "/var/lib/munge",
                      "/var/lib/dpkg" }

local function system_dir_of(path)
  local parts = {}
  for p in string.gmatch(path, "[^/]+") do
    if p ~= "." then parts[#parts + 1] = p end
  end
  local norm = "/" .. table.concat(parts, "/")
  if norm == "/" then return "/" end
  for _, d in ipairs(SYSTEM_DIRS) do
    if string.sub(d, -1) == "*" then
      local head = string.sub(d, 1, -2)
      if string.sub(norm, 1, #head) == head then return d end
    elseif norm == d or string.sub(norm, 1, #d + 1) == d .. "/" then
      return d
    end
  end
  return nil
end

local FLOAT_LIMITS = { weight = 1e6, restart_s = 1e7 }
local REQUIRED = { "min_gpus", "max_gpus", "min_batch", "max_batch", "max_local_batch" }
-- The operators whose updates always pass: root, and the SlurmUser uid if it is not root.
local DAEMON_UIDS = { [0] = true }

-- THE rule for "is this job elastic", byte for byte the same as slurm_elastic.spec.comment_kind
-- (docs/SPEC.md): "elastic" when the comment starts with "elastic:" at its first byte; "malformed"
-- when "elastic:" (any ASCII case) follows only whitespace, control or non-ASCII bytes (NBSP, \x1f,
-- a zero-width space...) or is in another case; else "plain". Malformed comments are refused.
local function comment_kind(comment)
  if comment == nil or comment == "" then return "plain" end
  if string.sub(comment, 1, #PREFIX) == PREFIX then return "elastic" end
  local i = 1
  while i <= #comment do
    local b = string.byte(comment, i)
    if not (b <= 32 or b == 127 or b >= 128) then break end
    i = i + 1
  end
  if string.lower(string.sub(comment, i, i + #PREFIX - 1)) == PREFIX then return "malformed" end
  return "plain"
end

local function is_elastic(comment)
  return comment_kind(comment) ~= "plain"
end
comment_kind_of = comment_kind -- for the differential test (tests/unit/test_submit_plugin_lua.py)
is_elastic_comment = is_elastic

local function trim(s)
  return (string.gsub(s, "^%s*(.-)%s*$", "%1"))
end

local function fail(field, message)
  return "slurm-elastic: invalid elastic spec, field '" .. field .. "': " .. message
end

local function parse_int(value, key)
  if not string.find(value, "^[0-9]+$") or #value > 15 then
    return nil, fail(key, "expected a positive integer, got '" .. value .. "'")
  end
  local n = tonumber(value)
  if n < 1 then return nil, fail(key, "must be at least 1") end
  if n > INT_LIMITS[key] then return nil, fail(key, value .. " exceeds the limit " .. INT_LIMITS[key]) end
  return n
end

-- The Python parser's number syntax: [0-9]{1,15}(\.[0-9]{1,12})?([eE][+-]?[0-9]{1,3})?
local function float_syntax(value)
  local int, rest = string.match(value, "^([0-9]+)(.*)$")
  if not int or #int > 15 then return false end
  local frac, after = string.match(rest, "^%.([0-9]+)(.*)$")
  if frac then
    if #frac > 12 then return false end
    rest = after
  end
  if rest == "" then return true end
  local exp = string.match(rest, "^[eE][+-]?([0-9]+)$")
  return exp ~= nil and #exp <= 3
end

local function parse_float(value, key, limit)
  if not float_syntax(value) then
    return nil, fail(key, "expected a non-negative number, got '" .. value .. "'")
  end
  local x = tonumber(value)
  if x == nil or x ~= x or x > (limit or FLOAT_LIMITS[key]) then return nil, fail(key, value .. " is out of range") end
  return x
end

-- Same bounds as the Python parser (spec._parse_points): at most 256 points, GPUs 1..2^20, batch
-- 1..MAX_BATCH (2^24), throughput a finite positive number up to 1e12. A point the daemon would reject must be
-- refused here, or the job is accepted, held, and never placed.
local function check_points(value)
  local n = 0
  for item in string.gmatch(value .. "|", "([^|]*)|") do
    n = n + 1
    if n > 256 then return fail("points", "at most 256 points") end
    local g, b, t = string.match(item, "^([0-9]+)x([0-9]+)@([0-9.eE+-]+)$")
    if not g or #g > 7 or #b > 13 or #t > 30 then
      return fail("points", "expected GPUSxBATCH@SAMPLES_PER_S items joined by '|', got '" .. item .. "'")
    end
    local gn, bn = tonumber(g), tonumber(b)
    if gn < 1 or gn > 1048576 or bn < 1 or bn > MAX_BATCH then
      return fail("points", "GPU count or batch out of range in '" .. item .. "'")
    end
    local x, err = parse_float(t, "points", 1e12)
    if x == nil then return err end
    if x <= 0 then return fail("points", "throughput must be positive in '" .. item .. "'") end
  end
  return nil
end

local function reachable(s, k)
  for a = 1, math.min(s.max_accum, 64) do
    local step = k * a
    local lo = math.max(s.min_local_batch, math.ceil(s.min_batch / step))
    local hi = math.min(s.max_local_batch, math.floor(s.max_batch / step))
    if lo <= hi then return true end
  end
  return false
end

-- Returns nil when the spec is valid, else the message for the user.
function elastic_spec_error(comment)
  if comment_kind(comment) ~= "elastic" then
    return fail("comment", "the comment must start with '" .. PREFIX .. "' at its first character " ..
                "(found whitespace, control or non-ASCII characters, or another letter case, before it)")
  end
  local body = string.sub(comment, #PREFIX + 1)
  if #body > 4096 then return fail("comment", "longer than 4096 characters") end
  local s = {}
  for item in string.gmatch(body .. ",", "([^,]*),") do
    item = trim(item)
    if item ~= "" then
      local key, value = string.match(item, "^([^=]*)=(.*)$")
      if key == nil then return fail(item, "expected key=value") end
      key, value = trim(key), trim(value)
      if key == "" then return fail("comment", "empty key") end
      if s[key] ~= nil then return fail(key, "given twice") end
      if INT_LIMITS[key] then
        local n, err = parse_int(value, key)
        if err then return err end
        s[key] = n
      elseif FLOAT_LIMITS[key] then
        local x, err = parse_float(value, key)
        if err then return err end
        s[key] = x
      elseif key == "profile" or key == "pace" then
        if not string.find(value, "^[A-Za-z0-9_.-]+$") or #value > 64 then
          return fail(key, "expected a profile name ([A-Za-z0-9_.-]), got '" .. value .. "'")
        end
        s[key] = value
      elseif key == "max_failures" then
        if not string.find(value, "^[0-9][0-9]?[0-9]?$") or tonumber(value) > 100 then
          return fail(key, "expected an integer 0..100, got '" .. value .. "'")
        end
        s[key] = tonumber(value)
      elseif key == "resume" then
        if value ~= "auto" and value ~= "must" then
          return fail(key, "expected auto or must, got '" .. string.sub(value, 1, 40) .. "'")
        end
        s[key] = value
      elseif key == "ckpt_dir" then
        local rest = string.gsub(value, "%%j", "")
        if not string.find(value, "^/[A-Za-z0-9_./%%+-]*$") or #value > 256 or string.find(rest, "%%")
           or string.find(value .. "/", "/%.%./") then
          return fail(key, "expected an absolute path of [A-Za-z0-9_./+-] (and %j for the job id)")
        end
        local sysdir = system_dir_of(value)
        if sysdir then
          return fail(key, "'" .. value .. "' is a system directory (" .. sysdir .. "); use a directory of your own")
        end
        s[key] = value
      elseif key == "points" then
        local err = check_points(value)
        if err then return err end
        s[key] = value
      elseif key == "local_batch_by_type" then
        -- issue 23: TYPE:MAX_LOCAL_BATCH items joined by '|', checked against the batch limits below
        local limits, n, seen = {}, 0, {}
        for part in string.gmatch(value .. "|", "([^|]*)|") do
          n = n + 1
          if n > 16 then return fail(key, "at most 16 GPU types") end
          local t, lim = string.match(part, "^([A-Za-z0-9_.-]+):([0-9]+)$")
          if t == nil or #t > 64 or #lim > 15 then
            return fail(key, "expected TYPE:MAX_LOCAL_BATCH items joined by '|'")
          end
          if seen[t] then return fail(key, "GPU type '" .. t .. "' given twice") end
          seen[t] = true
          local x = tonumber(lim)
          if x < 1 or x > MAX_BATCH then return fail(key, lim .. " is outside 1.." .. MAX_BATCH) end
          limits[#limits + 1] = x
        end
        s[key] = limits
      else
        return fail(string.sub(key, 1, 40), "unknown key")
      end
    end
  end
  for _, key in ipairs(REQUIRED) do
    if s[key] == nil then return fail(key, "required") end
  end
  s.min_local_batch = s.min_local_batch or 1
  s.max_accum = s.max_accum or 1
  if s.weight ~= nil and s.weight <= 0 then return fail("weight", "must be positive") end
  if s.min_gpus > s.max_gpus then return fail("min_gpus", "min_gpus > max_gpus") end
  if s.min_batch > s.max_batch then return fail("min_batch", "min_batch > max_batch") end
  if s.min_local_batch > s.max_local_batch then return fail("min_local_batch", "min_local_batch > max_local_batch") end
  for _, lim in ipairs(s.local_batch_by_type or {}) do
    if lim < s.min_local_batch or lim > s.max_local_batch then
      return fail("local_batch_by_type", "a type's limit is outside [min_local_batch, max_local_batch]")
    end
  end
  if s.batch ~= nil and (s.batch < s.min_batch or s.batch > s.max_batch) then
    return fail("batch", "outside [min_batch, max_batch]")
  end
  if s.gpus ~= nil and (s.gpus < s.min_gpus or s.gpus > s.max_gpus) then
    return fail("gpus", "outside [min_gpus, max_gpus]")
  end
  if s.gpus_per_node ~= nil and s.gpus_per_node > s.max_gpus then
    return fail("gpus_per_node", "gpus_per_node > max_gpus")
  end
  local found = false
  for k = s.min_gpus, math.min(s.max_gpus, s.min_gpus + 4096) do
    if (s.gpus_per_node == nil or k % s.gpus_per_node == 0) and reachable(s, k) then
      found = true
      break
    end
  end
  if not found then
    return fail("max_batch", "no allowed GPU count can run a global batch in [min_batch, max_batch]")
  end
  return nil
end

local function job_submit(job_desc, part_list, submit_uid)
  if not is_elastic(job_desc.comment) then
    return slurm.SUCCESS
  end
  local err = elastic_spec_error(job_desc.comment)
  if err then
    slurm.log_user("%s", err)
    return slurm.ERROR
  end
  if job_desc.requeue ~= 1 then
    slurm.log_user("%s", "slurm-elastic: elastic jobs must be submitted with --requeue (the daemon resizes them by requeueing)")
    return slurm.ERROR
  end
  job_desc.priority = 0 -- held until the slurm-elastic daemon places it
  slurm.log_info("slurm-elastic: held elastic job from uid %u for the daemon", submit_uid)
  return slurm.SUCCESS
end

-- Refusals of an update. On 22.05 slurm.log_user() is discarded in job_modify (slurmctld logs "Use
-- of log.user() in job_modify is not supported"), so the return code is what scontrol shows there:
-- "Access/permission denied" for a forbidden change, "Invalid argument" for a malformed spec; 24.11
-- also prints the message. The full message (job, uid, field) always goes to the slurmctld log.
local EINVAL = 22

local function refuse(code, job_id, uid, message)
  slurm.log_user("%s", message)
  slurm.log_info("slurm-elastic: refused update of job %s by uid %s: %s", tostring(job_id), tostring(uid), message)
  return code
end

local function job_modify(job_desc, job_rec, part_list, modify_uid)
  if DAEMON_UIDS[modify_uid] then
    return slurm.SUCCESS
  end
  local denied = slurm.ESLURM_ACCESS_DENIED or slurm.ERROR
  local jid = job_rec ~= nil and job_rec.job_id or "?"
  local old_kind = comment_kind(job_rec ~= nil and job_rec.comment or nil)
  local elastic_now = old_kind ~= "plain"
  if job_desc.comment ~= nil then
    local new_kind = comment_kind(job_desc.comment)
    -- A job stays what it was submitted as: an elastic job that turned plain would stay held (or run
    -- unmanaged once released); a plain job that turned elastic would be resized without --requeue
    -- or a USR2 handler checked at submit.
    if elastic_now and new_kind == "plain" then
      return refuse(denied, jid, modify_uid, "slurm-elastic: job " .. tostring(jid) .. " is elastic; its comment " ..
                    "must keep an elastic: spec (cancel it and submit a plain job instead)")
    end
    if not elastic_now and new_kind ~= "plain" then
      return refuse(denied, jid, modify_uid, "slurm-elastic: job " .. tostring(jid) .. " was not submitted as elastic; " ..
                    "submit a new job with --comment=elastic:... --requeue")
    end
    if new_kind ~= "plain" then
      local err = elastic_spec_error(job_desc.comment)
      if err then return refuse(EINVAL, jid, modify_uid, err) end
    end
  end
  if elastic_now and job_desc.priority ~= nil and job_desc.priority ~= slurm.NO_VAL then
    return refuse(denied, jid, modify_uid, "slurm-elastic: job " .. tostring(jid) ..
                  " is elastic; the slurm-elastic daemon starts and releases it")
  end
  if elastic_now and job_desc.requeue == 0 then
    return refuse(denied, jid, modify_uid, "slurm-elastic: job " .. tostring(jid) ..
                  " is elastic; it must stay requeueable (the daemon resizes it by requeueing)")
  end
  return slurm.SUCCESS
end

-- Fail closed: after an error inside this script Slurm logs it and accepts the job, unheld; for an
-- elastic job we reject it instead, so that it never starts behind the daemon's back.
local function guarded(fn, comment, ...)
  local ok, result = pcall(fn, ...)
  if ok then return result end
  slurm.log_error("slurm-elastic job_submit.lua: %s", tostring(result))
  if is_elastic(comment) then
    slurm.log_user("%s", "slurm-elastic: internal error while checking the elastic spec; request refused")
    return slurm.ERROR
  end
  return slurm.SUCCESS
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  return guarded(job_submit, job_desc.comment, job_desc, part_list, submit_uid)
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  local comment = job_desc.comment
  if comment == nil and job_rec ~= nil then comment = job_rec.comment end
  return guarded(job_modify, comment, job_desc, job_rec, part_list, modify_uid)
end

return slurm.SUCCESS
