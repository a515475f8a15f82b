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
local INT_LIMITS = {
  min_gpus = 2^20, max_gpus = 2^20, gpus = 2^20, gpus_per_node = 2^20,
  min_batch = 2^40, max_batch = 2^40, batch = 2^40, max_local_batch = 2^40, min_local_batch = 2^40,
  max_accum = 2^12,
}
local FLOAT_LIMITS = { weight = 1e6, restart_s = 1e7 }
local REQUIRED = { "min_gpus", "max_gpus", "min_batch", "max_batch", "max_local_batch" }
-- The operators whose updates always pass: root, and the SlurmUser uid if it is not root.
local DAEMON_UIDS = { [0] = true }

local function is_elastic(comment)
  return comment ~= nil and string.find(comment, "^%s*elastic:") ~= nil
end

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
-- 1..2^40, throughput a finite positive number up to 1e12. A point the daemon would reject must be
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
    if gn < 1 or gn > 2^20 or bn < 1 or bn > 2^40 then
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
  local body = string.sub(trim(comment), #PREFIX + 1)
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
      elseif key == "profile" then
        if not string.find(value, "^[A-Za-z0-9_.-]+$") or #value > 64 then
          return fail(key, "expected a profile name ([A-Za-z0-9_.-]), got '" .. value .. "'")
        end
        s[key] = value
      elseif key == "max_failures" then
        if not string.find(value, "^[0-9][0-9]?[0-9]?$") or tonumber(value) > 100 then
          return fail(key, "expected an integer 0..100, got '" .. value .. "'")
        end
        s[key] = tonumber(value)
      elseif key == "ckpt_dir" then
        local rest = string.gsub(value, "%%j", "")
        if not string.find(value, "^/[A-Za-z0-9_./%%+-]*$") or #value > 256 or string.find(rest, "%%")
           or string.find(value .. "/", "/%.%./") then
          return fail(key, "expected an absolute path of [A-Za-z0-9_./+-] (and %j for the job id)")
        end
        s[key] = value
      elseif key == "points" then
        local err = check_points(value)
        if err then return err end
        s[key] = value
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

local function job_modify(job_desc, job_rec, part_list, modify_uid)
  if DAEMON_UIDS[modify_uid] then
    return slurm.SUCCESS
  end
  local elastic_now = job_rec ~= nil and is_elastic(job_rec.comment)
  if job_desc.comment ~= nil and is_elastic(job_desc.comment) then
    local err = elastic_spec_error(job_desc.comment)
    if err then
      slurm.log_user("%s", err)
      return slurm.ERROR
    end
    elastic_now = true
  end
  if elastic_now and job_desc.priority ~= nil and job_desc.priority ~= slurm.NO_VAL then
    slurm.log_user("%s", "slurm-elastic: job " .. tostring(job_rec.job_id) ..
                   " is elastic; the slurm-elastic daemon starts and releases it")
    return slurm.ERROR
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
